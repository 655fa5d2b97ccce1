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
        x = tl.load(
            x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        acc = tl.dot(x, tl.trans(w), acc)  # [BM, BK] @ [BK, BN]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config: int) -> torch.Tensor:
    """``x [M, K] @ w[N, K]^T`` with ``CONFIGS[config]``, for M up to ``MAX_ROWS`` (bf16 or fp16, contiguous K)."""
    bn, bk, warps, stages = CONFIGS[config]
    m, k = x.shape
    n = w.shape[0]
    y = x.new_empty(m, n)
    _skinny_gemm[(triton.cdiv(n, bn),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BM=MAX_ROWS, BN=bn, BK=bk, num_warps=warps, num_stages=stages,
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
