"""A Triton GEMM for few rows on accelerators: ``y[M, N] = x[M, K] @ w[N, K]^T`` for decode-sized ``M``.

A decode step streams every weight once and does little else, so its linears are bound by how fast they read
the weights. On an H100 (Llama-3-8B shapes, bf16, batch 1) cuBLASLt picks split-K kernels for the 4096-wide
projections and reads the weights at about 2.5 TB/s where a plain copy moves 2.9, and the split-K reductions are
kernels of their own. Here each program owns ``BN`` output columns and walks all of ``K`` in ``BK`` steps,
loading each weight tile once for every row (the rows are padded to 16 for one ``tl.dot``, whose extra work is
free in a memory-bound kernel), with fp32 accumulation and no second pass.

Which layers take it is decided once, at start-up, by timing it against ``F.linear`` on each distinct weight
shape (:func:`tune_linears`): a shape where cuBLAS is as fast keeps cuBLAS. Above ``MAX_ROWS`` rows (prefill)
every layer runs ``F.linear``. Imported only where Triton is installed (the CUDA device).
"""

from __future__ import annotations

import logging
import math
from types import MethodType

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.fused_projections import model_linears
from engine.swapped_forward import runs_forward

logger = logging.getLogger(__name__)

MAX_ROWS = 16  # rows of one tl.dot: up to this many, the kernel; above, F.linear

# (BN, BK, warps, stages), tried per weight shape at start-up. Small BN gives more programs for the narrow,
# deep weights (the MLP's down projection: 4096 columns of 14336); large BN fewer, longer tiles for wide ones.
CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (16, 256, 4, 4),
    (16, 512, 4, 3),
    (32, 256, 4, 4),
    (64, 128, 4, 4),
    (32, 512, 8, 3),
)


@triton.jit
def _skinny_gemm(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BM: tl.constexpr,  # rows, padded (16)
    BN: tl.constexpr,  # output columns per program
    BK: tl.constexpr,  # K per iteration
    GATED: tl.constexpr,  # x is a gated MLP's [M, 2K] gate|up: the kernel multiplies silu(gate) * up itself
):
    pid = tl.program_id(0)
    n = pid.to(tl.int64) * BN + tl.arange(0, BN)  # int64: N * K can pass 2^31 (a large vocabulary's head)
    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    n_ok = n < N
    m_ok = m < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + kk
        k_ok = k < K
        w = tl.load(
            w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
        )
        x_ok = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=x_ok, other=0.0)
        if GATED:
            # silu(gate) * up in fp32, rounded once to the weights' dtype (as a compiled forward's fused kernel
            # rounds it), from the gate and up halves of the row
            up = tl.load(x_ptr + m[:, None] * stride_xm + K + k[None, :], mask=x_ok, other=0.0).to(tl.float32)
            gate = x.to(tl.float32)
            x = (gate * tl.sigmoid(gate) * up).to(w.dtype)
        acc = tl.dot(x, tl.trans(w), acc)  # [BM, BK] @ [BK, BN]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config: int, gated: bool = False) -> torch.Tensor:
    """``x [M, K] @ w[N, K]^T`` with ``CONFIGS[config]``, for M up to ``MAX_ROWS`` (bf16 or fp16, contiguous K).
    ``gated``: x is ``[M, 2K]``, a gated MLP's gate and up side by side, and the product is
    ``(silu(gate) * up) @ w^T``."""
    bn, bk, warps, stages = CONFIGS[config]
    m = x.shape[0]
    n, k = w.shape
    if x.shape[1] != (2 * k if gated else k):
        raise ValueError(f"rows of {x.shape[1]} for a weight of {k} columns{' (gated: 2x)' if gated else ''}")
    y = x.new_empty(m, n)
    _skinny_gemm[(triton.cdiv(n, bn),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BM=MAX_ROWS, BN=bn, BK=bk, GATED=gated, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def _skinny_or_linear(x: torch.Tensor, w: torch.Tensor, config: int) -> torch.Tensor:
    """The linear of a layer that took the kernel: the kernel up to ``MAX_ROWS`` rows, ``F.linear`` above."""
    if x.shape[0] <= MAX_ROWS and x.stride(-1) == 1:
        return skinny_gemm(x, w, config)
    return F.linear(x, w)


@torch.library.custom_op("bucketserve::skinny_gemm", mutates_args=())
def skinny_linear_op(x: torch.Tensor, w: torch.Tensor, config: int) -> torch.Tensor:
    """:func:`_skinny_or_linear` as one opaque operator, so one compiled graph (dynamic in the token count) keeps
    the choice by row count at run time."""
    return _skinny_or_linear(x, w, config)


@skinny_linear_op.register_fake
def _skinny_linear_fake(x: torch.Tensor, w: torch.Tensor, config: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def _gated_or_linear(gate_up: torch.Tensor, w: torch.Tensor, config: int) -> torch.Tensor:
    """``(silu(gate) * up) @ w^T`` for ``gate_up [M, 2K]``: the gated kernel up to ``MAX_ROWS`` rows, else the
    activation and ``F.linear``."""
    if gate_up.shape[0] <= MAX_ROWS and gate_up.stride(-1) == 1:
        return skinny_gemm(gate_up, w, config, gated=True)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w)


@torch.library.custom_op("bucketserve::skinny_gated_gemm", mutates_args=())
def skinny_gated_op(gate_up: torch.Tensor, w: torch.Tensor, config: int) -> torch.Tensor:
    """:func:`_gated_or_linear` as one opaque operator (see ``skinny_linear_op``)."""
    return _gated_or_linear(gate_up, w, config)


@skinny_gated_op.register_fake
def _skinny_gated_fake(gate_up: torch.Tensor, w: torch.Tensor, config: int) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape[0], w.shape[0])


def _gated_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # x [..., hidden] -> gate|up [M, 2 * intermediate] (one GEMM) -> the down projection with the activation in it
    gate_up = self.fused_linear(x.reshape(-1, x.shape[-1]))  # [M, 2I]
    down = self.down_proj
    fn = skinny_gated_op if torch.compiler.is_compiling() else _gated_or_linear
    return fn(gate_up, down.weight, down.skinny_config).view(*x.shape[:-1], down.out_features)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # x [..., K] -> [..., N]
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    # Eager calls skip the operator's dispatch, as the CPU's prepacked linears do.
    fn = skinny_linear_op if torch.compiler.is_compiling() else _skinny_or_linear
    return fn(flat, self.weight, self.skinny_config).view(*x.shape[:-1], self.out_features)


def _time_ms(fn, inputs: list, reps: int = 20) -> float:
    """ms per call of ``fn``, cycling through ``inputs`` (weights beyond the L2 cache): ``reps`` calls captured in
    one CUDA graph, the fastest of three replays. A graph, because the decode step replays its linears from one:
    timed call by call, the host's launch cost (larger for a Triton launch from Python than for cuBLAS) would
    hide the kernels' own time on every weight smaller than about 100 MB."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm (and compile) off the capture
        for args in inputs[:2]:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(*inputs[i % len(inputs)])
    best = math.inf
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    del graph
    return best


def pick_config(n: int, k: int, dtype: torch.dtype, device: torch.device) -> tuple[int | None, dict]:
    """The fastest config for a weight ``[n, k]`` at 1 and at ``MAX_ROWS`` rows, or None where ``F.linear`` is
    as fast at either; with the timings (ms) it was picked by."""
    copies = max(1, min(8, math.ceil(256 * 2**20 / (n * k * torch.tensor([], dtype=dtype).element_size()))))
    weights = [torch.randn(n, k, dtype=dtype, device=device) for _ in range(copies)]
    rows = {m: torch.randn(m, k, dtype=dtype, device=device) for m in (1, MAX_ROWS)}
    timings: dict = {"cublas": {m: _time_ms(F.linear, [(x, w) for w in weights]) for m, x in rows.items()}}
    best, best_ms = None, None
    for c in range(len(CONFIGS)):
        try:
            t = {
                m: _time_ms(lambda a, b, c=c: skinny_gemm(a, b, c), [(x, w) for w in weights])
                for m, x in rows.items()
            }
        except Exception as e:  # a config this GPU cannot run (shared memory, say): skip it
            logger.debug("skinny GEMM config %s failed on [%d, %d]: %s", CONFIGS[c], n, k, e)
            continue
        timings[CONFIGS[c]] = t
        if all(t[m] < timings["cublas"][m] for m in rows) and (best_ms is None or t[1] < best_ms):
            best, best_ms = c, t[1]
    return best, timings


@torch.inference_mode()
def tune_linears(model: torch.nn.Module) -> dict:
    """Give each bias-free bf16/fp16 linear of ``model`` whose weight shape runs faster on the kernel (timed here,
    per shape) the kernel's forward; returns {(n, k): (config or None, timings)}."""
    linears = [
        m
        for m in model_linears(model)
        if m.bias is None
        and m.weight.is_cuda
        and m.weight.dtype in (torch.bfloat16, torch.float16)
        and m.weight.is_contiguous()
    ]
    picked: dict[tuple[int, int], tuple[int | None, dict]] = {}
    for module in linears:
        shape = (module.out_features, module.in_features)
        if shape not in picked:
            try:
                picked[shape] = pick_config(*shape, module.weight.dtype, module.weight.device)
            except Exception as e:  # timing failed (a capture error, say): this shape keeps cuBLAS
                logger.warning("could not time the skinny GEMM on [%d, %d] (%s): cuBLAS", *shape, e)
                picked[shape] = (None, {"error": str(e)})
        config = picked[shape][0]
        if config is not None:
            module.skinny_config = config
            module.forward = MethodType(_forward, module)
    swapped = sum(1 for m in linears if hasattr(m, "skinny_config"))
    logger.info(
        "skinny GEMM kernel for %d of %d linears (%s)",
        swapped,
        len(linears),
        ", ".join(f"{n}x{k}: {'cuBLAS' if c is None else CONFIGS[c]}" for (n, k), (c, _) in picked.items()),
    )
    return picked


# How far the gated kernel's MLP output may lie from the MLP's own forward, as a fraction of its largest magnitude:
# the activation is rounded once instead of twice, and the kernel sums in another order than the GEMM it replaces.
_GATED_TOLERANCE = {torch.bfloat16: 2**-5, torch.float16: 2**-7}


def _gated_disagreement(mlp: torch.nn.Module, gen: torch.Generator) -> str | None:
    """Why the gated forward cannot stand in for ``mlp``'s own, on probe rows; None if it can."""
    weight = mlp.down_proj.weight
    probe = torch.randn(64, generator=gen).to(weight.device, weight.dtype)
    if not torch.equal(mlp.act_fn(probe), F.silu(probe)):
        return "its activation is not SiLU"
    hidden = mlp.fused_linear.in_features
    for rows in (1, MAX_ROWS, MAX_ROWS + 3):  # the kernel, and the fallback above its rows
        x = torch.randn(rows, hidden, generator=gen).to(weight.device, weight.dtype)
        want, got = mlp(x).float(), _gated_mlp_forward(mlp, x).float()
        error = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
        if not error <= _GATED_TOLERANCE[weight.dtype]:
            return f"outputs differ by {error:.3g} of their largest magnitude at {rows} rows"
    return None


@torch.inference_mode()
def fuse_gated_downs(model: torch.nn.Module) -> int:
    """Give each gated MLP whose gate/up are one GEMM (``engine.fused_projections``) and whose down projection took
    the kernel (:func:`tune_linears`) a forward that runs ``silu(gate) * up`` inside the down projection's kernel,
    one elementwise kernel a layer fewer, where it reproduces the MLP's own on a probe; returns how many."""
    from engine.fused_projections import _mlp_forward, fused_linear_of

    gen = torch.Generator().manual_seed(0)
    fused = 0
    for module in model.modules():
        down = getattr(module, "down_proj", None)
        gate_up = fused_linear_of(module)
        if not (
            runs_forward(module, _mlp_forward)
            and gate_up is not None
            and gate_up.bias is None
            and isinstance(down, torch.nn.Linear)
            and down.bias is None
            and hasattr(down, "skinny_config")
            and down.weight.dtype in _GATED_TOLERANCE
            and gate_up.out_features == 2 * down.in_features
        ):
            continue
        why = _gated_disagreement(module, gen)
        if why is not None:
            logger.info(
                "%s keeps its activation apart from the down projection: %s", type(module).__name__, why
            )
            continue
        module.forward = MethodType(_gated_mlp_forward, module)
        fused += 1
    if fused:
        logger.info("silu(gate) * up inside the down projection's kernel in %d MLPs", fused)
    return fused


def is_gated_down(module: torch.nn.Module) -> bool:
    """Whether :func:`fuse_gated_downs` swapped this MLP's forward."""
    return runs_forward(module, _gated_mlp_forward)
