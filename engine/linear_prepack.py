"""Prepacked linear layers on CPU: each ``nn.Linear`` of the model multiplies through oneDNN with its weight
reordered once, at load, into oneDNN's blocked layout.

Measured on this 2-core AVX-512 host (fp32, ``[M, 512] x [512, 1408]``): oneDNN with a prepacked weight runs a
decode-sized GEMM (M = 8) in 0.057 ms against 0.165 ms for ``F.linear`` (MKL, unpacked), a large one at about
2.3x the rate, and the 32000-row LM head at M = 8 in 2.0 ms against 9.3 ms; results stay fp32-accurate.

Few rows (decode steps and small chunks, up to ``skinny_max_rows``) go to our own kernel instead
(``engine/kernels/skinny_linear_cpu.cpp``), on a second copy of the weight laid out in 16-column panels: a
decode step streams every weight once, and oneDNN's GEMM, blocked for larger M, reads them at 55-75% of that
kernel's rate from M = 1 to 32 (measured on the same host, 2 threads, fp32, weights beyond the caches:
``[8, 512] x [512, 1408]`` at 25.0 GB/s against 17.6, ``[8, 512] x [512, 256]`` at 30.8 against 11.2,
``[32, 512] x [512, 1408]`` at 12.7 against 10.5); the two meet near M = 64. bf16 weights take the same
kernel, widened exactly to fp32 as they are read (half the bytes, fp32 arithmetic): 1.24-1.79x oneDNN's bf16
GEMM from M = 1 to 96 on this host, whose CPU exposes AVX512_BF16 but no AMX. On an AMD CPU with AVX512_BF16,
bf16 rows over bf16 weights are multiplied in pairs of k steps by its dot-product instruction instead (fp32
accumulators; the kernel's ``panel_rows_dot``): on a 2-core Zen 4 EPYC `small`'s four linears of a layer took
0.90 / 0.71 / 0.58 / 0.52 / 0.48 of the widened pass's time at 1 / 8 / 16 / 32 / 64 rows, and meet oneDNN's bf16
GEMM near 64 rows (0.76 of its time at 16, 0.90 at 32, 1.02 at 64). Intel's cores issue that instruction at a
quarter of the FMA's rate (half its flops): on a 2-core Xeon with AMX the pass took 1.25-1.41x the widened one's
time from 8 to 24 rows, so Intel CPUs widen (``engine/kernels/cpu_features.h``), or, where they have AMX, multiply
calls of 2 bf16 rows or more on the matrix unit: each panel's 32 k steps, stored as (k, k + 1) pairs per column
(``panel_layout``), loaded as one tile times a 16-row tile of x (``panels_amx``). On a 2-core Xeon with AMX that
took 0.52 of the widened pass's time at 16 rows and 0.32 at 64, 0.63 of oneDNN's AMX GEMM at 16-32 rows and 0.89 at
48-64 (measured before the pair layout, when each line was permuted first). The panel copy costs one more copy of
the linear weights.

The model classes stay transformers' own: only each linear module's ``forward`` is replaced, on the instance,
by one that calls the packed operator; the original weight stays in place (tied embeddings and checkpoint
code still see it).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import weakref
from collections.abc import Iterable, Iterator
from types import MethodType

import torch

from engine import huge_pages
from engine.cpu_model import host_cpu
from engine.skinny_rows import skinny_row_limit

logger = logging.getLogger(__name__)

# The batch size oneDNN tunes the packed layout for; any M runs, this one covers decode batches to prefill
# chunks well (measured: within 10% of the best hint from M = 1 to 512).
PACK_HINT_M = 32
# How many rows a linear runs on the skinny kernel (when it is built) before oneDNN takes it: per dtype and host
# (skinny_max_rows, engine/skinny_rows.py); 64 by default, as measured here (4096 for fp32 on an AMD Zen 2).
# AVX-512 (2-core host): 1.03-1.26x oneDNN's speed at 64 rows over the small model's shapes, 0.97-1.17x at 96.
# AVX2 (2-core Zen 3 EPYC, a 16-column panel in two 8-float registers, 3 rows a pass, the accumulators in named
# registers), over the small model's QKV, O, down and fused gate/up shapes: 1.7-2.2x oneDNN at 8 rows, 1.0-1.35x
# at 32, 0.9-1.4x at 64 (the gate/up pass, the largest, 1.28-1.42x), 0.77-1.28x at 128.
_CPU = torch.backends.cpu.get_cpu_capability()
SKINNY_PANEL = 16  # output columns per panel of the skinny kernel's weight layout


# Packed linear layers by index. A compiled graph cannot take a packed (opaque-layout) tensor as a graph input, so
# a layer's operator call carries an index under which its packed weight is found at run time: in the kernel
# extension's own registry (``remember_packed``), where the row count also picks the skinny kernel or oneDNN
# with no Python per call; or, on a host that could not build the extension, here, for an opaque Python
# operator. Each module owns its packed weight; both registries let go of it when the module goes.
_PACKED: dict[int, weakref.ref[torch.nn.Linear]] = {}
_next_index = itertools.count()


def _register(module: torch.nn.Linear) -> int:
    """A new index under which compiled graphs find ``module`` (held weakly)."""
    index = next(_next_index)
    _PACKED[index] = weakref.ref(module, lambda _, i=index: _PACKED.pop(i, None))
    return index


def _registered(index: int) -> torch.nn.Linear:
    module = _PACKED[index]()
    assert module is not None, "a packed linear layer was used after its model was freed"
    return module


def _onednn_matmul(x: torch.Tensor, index: int) -> torch.Tensor:
    module = _registered(index)
    return torch.ops.mkldnn._linear_pointwise(x, module.packed_weight, module.bias, "none", [], "")  # [M, N]


@torch.library.custom_op("bucketserve::packed_linear", mutates_args=())
def packed_linear_op(x: torch.Tensor, index: int) -> torch.Tensor:
    return _onednn_matmul(x, index)


@packed_linear_op.register_fake
def _packed_linear_fake(x: torch.Tensor, index: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _registered(index).out_features)


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Without the kernel extension: oneDNN for every row count."""
    # x [..., K] -> [..., N]
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    # Eager calls skip the operator's dispatch.
    fn = packed_linear_op if torch.compiler.is_compiling() else _onednn_matmul
    return fn(flat, self.packed_index).view(*x.shape[:-1], self.out_features)


def _dispatched_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """With the kernel extension: one C++ operator picks the skinny kernel (up to ``skinny_max_rows`` rows, when
    the layer has panels) or oneDNN."""
    # x [..., K] -> [..., N]
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    y = torch.ops.bucketserve_cpu.packed_linear(
        flat, self.panel_weight, self.bias, self.out_features, self.packed_index, self.skinny_max_rows
    )
    return y.view(*x.shape[:-1], self.out_features)


# The skinny kernel's ways of multiplying bf16 rows by bf16 weights (its linear_bf16_path), as the load log says them.
BF16_PATHS = {
    0: "widened to fp32 for FMAs",
    1: "multiplied in pairs by VDPBF16PS",
    2: "multiplied on AMX tiles (the fewest rows widened)",
}
AMX_PATH = 2


@functools.cache
def skinny_max_rows(dtype: torch.dtype) -> int:
    """Up to how many rows a linear of ``dtype`` runs on the skinny kernel on this host (``engine.skinny_rows``)."""
    ops = _kernels()
    prefetch = ops is not None and bool(ops.prefetches_fp32_weights())
    amx = bool(torch.cpu._is_amx_tile_supported())
    skinny_amx = ops is not None and int(ops.linear_bf16_path(True)) == AMX_PATH
    zen2 = host_cpu().amd_zen2
    name = str(dtype).removeprefix("torch.")
    return skinny_row_limit(name, _CPU, prefetch, amx, skinny_amx, zen2, onednn=onednn_has(dtype))


# The most rows a start-up probe sends to a layer's skinny side: a probe of the oneDNN side lowers the layer's limit
# to this meanwhile and takes one row more (a probe of limit + 1 rows would cost seconds where the limit is 4096).
PROBE_ROWS = 64


def probe_rows(dtype: torch.dtype) -> int:
    """The row limit under which a start-up probe runs layers of ``dtype`` (see ``skinny_rows_lowered``)."""
    return min(skinny_max_rows(dtype), PROBE_ROWS)


@contextlib.contextmanager
def skinny_rows_lowered(modules: Iterable[torch.nn.Linear], rows: int) -> Iterator[None]:
    """Meanwhile ``modules`` (prepacked linears) take the skinny kernel up to ``rows`` rows at most, so a probe of
    ``rows + 1`` rows runs their oneDNN side. Those without a oneDNN copy (bf16 where oneDNN has no bf16 path)
    have no other side: they keep their limit."""
    saved = [(m, m.skinny_max_rows) for m in modules if m.packed_weight is not None]
    for m, limit in saved:
        m.skinny_max_rows = min(limit, rows)
    try:
        yield
    finally:
        for m, limit in saved:
            m.skinny_max_rows = limit


def onednn_has(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies ``dtype`` on this CPU: fp32 wherever it is built, bf16 only where it has a bf16
    path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU has none)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this model's linears can be prepacked here: on the CPU, for oneDNN where it has the dtype (and the
    skinny kernel for few rows); bf16 on an AVX2 CPU without oneDNN's bf16 path, for the skinny kernel alone at
    every row count (``F.linear``'s bf16 GEMM runs at 5-8 GFLOP/s there: a 2-core Zen 2 EPYC, [M, 512] x [512,
    2816] at 1 to 1024 rows)."""
    if device.type != "cpu":
        return False
    return onednn_has(dtype) or (dtype == torch.bfloat16 and _wants_panels(dtype) and _kernels() is not None)


def panel_layout(w: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] as the skinny kernel's column panels [ceil(N / 16), K, 16], zero-padded past N.

    fp32 panels hold one k step per 16 values. bf16 panels hold two k steps per 32 values, as (k, k + 1) pairs
    per column (an odd K's last step alone in its 16): the layout the CPU's bf16 pair instructions and AMX tiles
    read, so the kernel never rearranges a weight line while it streams."""
    n, k = w.shape
    panels = -(-n // SKINNY_PANEL)
    padded = w.new_zeros(panels * SKINNY_PANEL, k)
    padded[:n] = w
    steps = padded.view(panels, SKINNY_PANEL, k).transpose(1, 2)  # [NP, K, 16]
    if w.dtype == torch.bfloat16 and k >= 2:
        even = k - k % 2
        pairs = (
            steps[:, :even].reshape(panels, even // 2, 2, SKINNY_PANEL).transpose(2, 3)
        )  # [NP, K/2, 16, 2]
        steps = torch.cat([pairs.reshape(panels, even, SKINNY_PANEL), steps[:, even:]], 1)
    # Decode steps stream these panels: on huge pages where the kernel has them (engine.huge_pages).
    return huge_pages.contiguous(steps)  # [NP, K, 16]


def _kernels():
    """The kernel extension's operators (``torch.ops.bucketserve_cpu``), or None where it cannot be built."""
    from engine.kernels.build import load_skinny_linear

    return None if load_skinny_linear() is None else torch.ops.bucketserve_cpu


def _wants_panels(dtype: torch.dtype) -> bool:
    """The skinny kernel where it was measured to help: fp32 or bf16 weights on an AVX-512 or AVX2 host (on
    AVX2, bf16 linears are not prepacked at all where oneDNN has no bf16 path: ``can_prepack``)."""
    return dtype in (torch.float32, torch.bfloat16) and _CPU in ("AVX512", "AVX2")


def prepack_linear(module: torch.nn.Linear, panels: bool) -> None:
    """Prepack one linear layer for oneDNN (and for the skinny kernel too where ``panels``, which needs the
    kernel extension) and swap its forward for the packed one."""
    ops = _kernels()
    w = module.weight.detach()  # [N, K]
    panels = panels and ops is not None
    onednn = onednn_has(w.dtype)
    if not onednn and not panels:
        raise ValueError(f"neither oneDNN nor the skinny kernel can take {w.dtype} linears on this CPU")
    index = _register(module)
    module.panel_weight = panel_layout(w) if panels else None
    # Without oneDNN's copy the skinny kernel takes every row count (skinny_max_rows).
    module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_M) if onednn else None
    module.packed_index = index
    module.skinny_max_rows = skinny_max_rows(w.dtype)
    if ops is not None:
        if onednn:
            ops.remember_packed(index, module.packed_weight)
            weakref.finalize(module, ops.forget_packed, index)
        module.forward = MethodType(_dispatched_forward, module)
    else:
        module.forward = MethodType(_onednn_forward, module)


def unpack_linear(module: torch.nn.Linear) -> None:
    """Undo ``prepack_linear``: the packed copies go, the layer runs its own ``F.linear`` again."""
    ops = _kernels()
    if ops is not None and getattr(module, "packed_index", None) is not None:
        ops.forget_packed(module.packed_index)
    module.panel_weight = module.packed_weight = module.packed_index = module.skinny_max_rows = None
    module.__dict__.pop("forward", None)


def prepack_linears(model: torch.nn.Module) -> int:
    """Swap every linear layer's forward for a prepacked oneDNN one (and the skinny kernel for few rows), or the
    skinny kernel's alone where oneDNN lacks the dtype (``can_prepack``); returns how many were packed."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not linears:
        return 0
    ops = _kernels()
    panels = ops is not None and _wants_panels(linears[0].weight.dtype)
    for module in linears:
        prepack_linear(module, panels)
    first = linears[0]
    how = ""
    if panels and first.weight.dtype == torch.float32:
        how = f" (fp32 weights prefetched in software: {ops.prefetches_fp32_weights()})"
    elif panels and first.weight.dtype == torch.bfloat16:
        how = f" (bf16 rows {BF16_PATHS[int(ops.linear_bf16_path(True))]})"
    if first.packed_weight is None:
        name = str(first.weight.dtype).removeprefix("torch.")
        logger.info(
            "prepacked %d linear layers for the skinny kernel alone, at every row count: oneDNN has no %s GEMM on "
            "this CPU%s",
            len(linears),
            name,
            how,
        )
    else:
        skinny = f", and for the skinny kernel up to {first.skinny_max_rows} rows{how}" if panels else ""
        logger.info("prepacked %d linear layers for oneDNN%s", len(linears), skinny)
    return len(linears)
