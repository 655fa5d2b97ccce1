"""Configuration of one worker actor (prefill, decode or colocated): frozen, validated, errors name the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from kv_transfer.config import TransferConfig
from kv_transfer.faults import FaultInjector

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    role: str
    engine: EngineConfig
    kv_transport: str = "grpc"
    transfer: TransferConfig = field(default_factory=TransferConfig)
    # Named actors this worker reports to (looked up in the worker's Ray namespace); None: no reporting.
    monitor_name: str | None = None
    controller_name: str | None = None
    # The cluster's Ray namespace, where those actors live (None: the worker's job namespace).
    namespace: str | None = None
    # torch intra-op threads; one per core the worker owns keeps prefill and decode from fighting.
    num_threads: int = 1
    # CPU cores to pin the worker process to (Linux); empty: no pinning.
    cpu_affinity: tuple[int, ...] = ()
    # Seconds between stats reports to the monitor (also sent after each batch, at most this often).
    heartbeat_s: float = 0.5
    # How long a decode worker keeps the id of an aborted request, so KV that arrives late is freed.
    tombstone_ttl_s: float = 120.0
    # Prefill: sender threads moving KV to decode workers while the next batch runs.
    num_senders: int = 2
    # Prefill: send each layer's KV as soon as the layer is computed (hides the transfer behind the rest of
    # the forward pass); False sends a request's KV after its batch; None: decided by layer_streaming().
    stream_kv_layers: bool | None = None
    # Chaos drills and fault tests only: damage done to this worker's outgoing KV chunks (None: none).
    kv_faults: FaultInjector | None = None
    # Started by the autoscaler into a running cluster: announces itself to the controller once warmed.
    joins: bool = False
    # Colocated, on a CPU: the engine's step token budget, in place of the engine config's (None: that one).
    # ``serve`` sets it where --max-num-batched-tokens is not given (engine.config.COLOCATED_CPU_STEP_TOKENS).
    cpu_step_tokens: int | None = None
    # Colocated: (core, its worker's id) of the other colocated workers pinned beside this one, whose cores a step
    # with a long prompt chunk may run on too (worker/neighbour_cores.py); empty: its own cores only.
    neighbour_cores: tuple[tuple[int, str], ...] = ()
    # Colocated: the longest such a step may pause a neighbour that is decoding (0: only idle neighbours lend).
    pause_neighbours_ms: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError(f"WorkerConfig.worker_id must be a non-empty string, got {self.worker_id!r}")
        if self.role not in ROLES:
            raise ValueError(f"WorkerConfig.role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"WorkerConfig.engine must be an EngineConfig, got {type(self.engine).__name__}")
        for name in ("num_threads", "num_senders"):
            check_count(self, name)
        if self.stream_kv_layers is not None and not isinstance(self.stream_kv_layers, bool):
            raise ValueError(
                f"WorkerConfig.stream_kv_layers must be a bool or None (auto), got {self.stream_kv_layers!r}"
            )
        for name in ("heartbeat_s", "tombstone_ttl_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"WorkerConfig.{name} must be > 0, got {value!r}")
        check_optional_count(self, "cpu_step_tokens")
        if any(not isinstance(c, int) or c < 0 for c in self.cpu_affinity):
            raise ValueError(f"WorkerConfig.cpu_affinity must be core ids >= 0, got {self.cpu_affinity!r}")
        if not isinstance(self.neighbour_cores, tuple) or any(
            not (isinstance(n, tuple) and len(n) == 2 and isinstance(n[0], int) and n[0] >= 0 and n[1])
            for n in self.neighbour_cores
        ):
            raise ValueError(
                "WorkerConfig.neighbour_cores must be a tuple of (core id >= 0, worker id) pairs, "
                f"got {self.neighbour_cores!r}"
            )
        p = self.pause_neighbours_ms
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise ValueError(f"WorkerConfig.pause_neighbours_ms must be an int >= 0, got {p!r}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_count(config: object, name: str) -> None:
    """Raise, naming the config class and field, unless ``config.name`` is an int >= 1 (a bool is not)."""
    value = getattr(config, name)
    if not _is_count(value):
        raise ValueError(f"{type(config).__name__}.{name} must be an int >= 1, got {value!r}")


def check_optional_count(config: object, name: str) -> None:
    """Raise, naming the config class and field, unless ``config.name`` is None or an int >= 1."""
    value = getattr(config, name)
    if value is not None and not _is_count(value):
        raise ValueError(f"{type(config).__name__}.{name} must be an int >= 1 or None, got {value!r}")


def layer_streaming(setting: bool | None, device: str, num_threads: int) -> bool:
    """Whether a prefill worker sends KV layer by layer during the forward pass. ``setting`` None (auto): not on a
    CPU worker of one thread, on otherwise. Streaming hides the transfer only where something else does the
    sending while the model computes: an accelerator's host thread, or spare cores. A one-thread CPU worker owns
    one core, so its sending thread takes that core (and the GIL) from the forward pass it was meant to overlap:
    measured on a 2-core host, 128-token prompts, one prefill and one decode worker, unloaded TTFT 60-61 ms
    streamed against 52-53 ms sent after the batch, and a burst of 8 at 244-309 against 202-206 ms."""
    if setting is not None:
        return setting
    return not (device == "cpu" and num_threads == 1)
