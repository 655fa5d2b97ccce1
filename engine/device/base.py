"""Device interface: everything hardware-specific the engine needs, behind one ABC and a registry.

Backends: ``cpu`` (here, and CI), ``cuda`` (CUDA graphs, NCCL), ``hpu`` (Intel Gaudi: HPU graphs,
HCCL; its module imports ``habana_frameworks.torch`` and is loaded only when that is installed).
The choice is made once at start-up (:func:`get_device`); nothing in the hot loop asks which device.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import ClassVar

import torch

# A captured (or plain) forward: takes the same tensors every call, returns the output tensor.
GraphFn = Callable[..., torch.Tensor]


class Device(abc.ABC):
    name: ClassVar[str]
    # torch.distributed backend for KV transfer between workers on this hardware.
    dist_backend: ClassVar[str]
    supports_graphs: ClassVar[bool] = False
    # Whether the flat runner captures its decode steps as graphs: the device has graphs and its paged-attention
    # operator never synchronises with the host on a decode step.
    flat_decode_graphs: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> bool: ...

    @property
    @abc.abstractmethod
    def torch_device(self) -> torch.device: ...

    @abc.abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the memory the KV cache and weights live in."""

    def prepare_process(self) -> None:  # noqa: B027 - optional hook
        """Process-wide settings this device's steps want, made once when an engine starts (CPU: the heap keeps
        freed activations for the next step, ``engine/heap.py``)."""

    def synchronize(self) -> None:  # noqa: B027 - optional hook, a no-op on CPU
        """Wait for queued work (no-op where execution is synchronous)."""

    def mark_step(self) -> None:  # noqa: B027 - optional hook, a no-op except on lazy-mode HPU
        """End a lazy-mode graph (HPU); a no-op elsewhere."""

    def reset_peak_memory(self) -> None:  # noqa: B027
        """Start a new peak-memory measurement (profiling pass)."""

    def peak_memory(self) -> int:
        """Peak bytes allocated since reset_peak_memory; 0 where unknown."""
        return 0

    def to_host_async(self, t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """Start copying ``t`` to the host without waiting for the work queued before it; returns the host tensor
        and a ``wait()`` after which it holds the data. Synchronous where execution is (the default)."""
        return t.cpu(), _ready

    def fuse_projections(self, model: torch.nn.Module) -> dict[str, int]:
        """Fuse, once at start-up, the linears that read the same input into one GEMM where this device runs them
        faster so (see :mod:`engine.fused_projections`); returns how many modules of each kind were fused
        (nothing where the device keeps them apart, as the CPU does: its prepacked path fuses on its own)."""
        return {}

    def fuse_rope_writes(self, model: torch.nn.Module) -> int:
        """Give, once at start-up, the attention layers of a model already on the flat attention implementation a
        forward whose rotary embedding and K/V cache writes run as one kernel of this device's, where it has one
        (see :mod:`engine.fused_rope_write`); returns how many layers took it (0 by default)."""
        return 0

    def tune_linears(self, model: torch.nn.Module) -> dict[str, dict]:
        """Pick, once at start-up, the fastest way this device has to run each of the model's linear layers at
        decode-sized row counts; returns what was picked per weight shape (nothing where there is one way)."""
        return {}

    def capture_graph(self, fn: GraphFn, static_inputs: dict[str, torch.Tensor]) -> GraphFn | None:
        """Capture ``fn(**static_inputs)`` as a replayable graph bound to those input buffers.

        Returns a zero-argument callable that replays it and returns the (static) output, or None
        where the device has no graphs. Callers copy fresh data into ``static_inputs`` before replay.
        """
        return None

    def paged_attention(self, dtype: torch.dtype | None = None) -> Callable[..., None]:
        """This device's paged-attention operator for flat tokens (see :mod:`engine.kernels`) for a KV cache of
        ``dtype``: the pure-torch one unless the device has its own. Chosen once, when the runner is built."""
        from engine.kernels import paged_attention_ref

        return paged_attention_ref

    def compile_options(self) -> dict:
        """Inductor options this device adds when the flat forward is compiled (none by default)."""
        return {}

    def kv_writer(self) -> Callable[..., None]:
        """How the flat runner writes a layer's new K/V into the paged cache (``forward_context.WriteFn``): two
        ``index_copy_`` unless the device has a kernel of its own. Chosen once, when the runner is built."""
        from engine.attention import write_slots

        return write_slots

    def greedy_splits(self, vocab: int) -> int:
        """Parts the greedy argmax over ``vocab`` logits is split into (``engine.sampler.greedy_tokens``): 1,
        one reduction, unless the device runs a split one faster."""
        return 1

    def decode_graph_widths(self, max_blocks: int) -> list[int]:
        """Block-table widths the flat runner captures decode graphs at (with ``flat_decode_graphs``), for
        sequences of up to ``max_blocks`` blocks: one width where the operator reads only the blocks each
        sequence has; several where its cost grows with the width it is given."""
        return [max_blocks]

    def describe(self) -> str:
        free, total = self.mem_get_info()
        return f"{self.name} ({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB)"


def _ready() -> None:
    pass


_REGISTRY: dict[str, Callable[[], type[Device]]] = {}


def register_device(name: str, loader: Callable[[], type[Device]]) -> None:
    """Register a backend by a loader, so a backend's imports run only when it is chosen."""
    _REGISTRY[name] = loader


def device_names() -> list[str]:
    return list(_REGISTRY)


def device_class(name: str) -> type[Device]:
    if name not in _REGISTRY:
        raise ValueError(f"device: unknown {name!r}; known: {device_names()}")
    return _REGISTRY[name]()


def get_device(name: str = "auto") -> Device:
    """'auto' picks hpu, then cuda, then cpu; a named device that is absent is an error."""
    if name == "auto":
        for candidate in ("hpu", "cuda", "cpu"):
            try:
                cls = device_class(candidate)
            except ImportError:
                continue
            if cls.is_available():
                return cls()
        raise RuntimeError("no device available")
    try:
        cls = device_class(name)
    except ImportError as e:
        raise RuntimeError(f"device {name!r} requested but its software stack is not installed: {e}") from e
    if not cls.is_available():
        raise RuntimeError(f"device {name!r} requested but not available on this machine")
    return cls()
