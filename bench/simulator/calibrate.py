"""Measure the real engine on this machine and fit the simulator's cost model.

The engine is built as a worker builds it (``LLMEngine(EngineConfig(model=..., skip_warmup=True))``, torch
threads as a worker's ``--num-threads``), and its model runner is timed on fixed shapes:

* prefill: ``runner.prefill`` on batches of ``B`` prompts of ``q`` tokens, for warmed ``(B, q)`` prompt shapes
  up to ``max_tokens`` tokens (so padding is nil and the shape is the one timed);
* decode: ``runner.decode`` on ``B`` sequences of ``c`` context tokens each, whose KV blocks are allocated but
  not computed (the kernel reads them all the same), padded by the runner to its warmed decode shape;
* KV transfer: the gRPC throughput of ``bench kv`` (``bench/results/kv.json``) when present, else a stated
  default, plus a fixed per-transfer latency.

Each shape is run once untimed, then ``repeats`` times; the median is kept. The fits are
:func:`~bench.simulator.cost_model.fit_prefill` and :func:`~bench.simulator.cost_model.fit_decode` (non-negative
least squares on relative error); the samples and the fit error go into the JSON beside the coefficients.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from bench.simulator.cost_model import CostModel, fit_decode, fit_error, fit_prefill

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
KV_REPORT = REPO_ROOT / "bench" / "results" / "kv.json"
DEFAULT_GRPC_GBPS = 0.7  # bench kv on this machine, 256 MiB (see bench/results/kv.md)
# One gRPC round trip with its acknowledgement on loopback, per request (a stated figure).
DEFAULT_TRANSFER_LATENCY_S = 2e-3


def _median_time(fn, repeats: int, sync=lambda: None) -> float:
    fn()  # first call pays one-off allocations
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()  # an accelerator runs asynchronously: time to the end of its work
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def transfer_gbps(report: Path = KV_REPORT) -> tuple[float, str]:
    try:
        doc = json.loads(report.read_text())
        gbps = float(doc["summary"]["grpc_gbps"])
        return gbps, f"gRPC {gbps} GB/s from {report.name} ({doc.get('command', '')})"
    except (OSError, KeyError, ValueError, TypeError):
        return DEFAULT_GRPC_GBPS, f"gRPC {DEFAULT_GRPC_GBPS} GB/s (stated default; no {report.name})"


def calibrate(
    model: str = "small",
    num_threads: int = 1,
    repeats: int = 3,
    max_prefill_tokens: int = 2048,
    max_decode_tokens: int = 16384,
    progress: bool = True,
    device: str = "cpu",
    dtype: str = "float32",
) -> tuple[CostModel, dict[str, Any]]:
    """Time the engine and fit a cost model; returns it and the raw samples."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import Request, SamplingParams

    torch.set_num_threads(num_threads)
    # Warm-up stays off on the CPU (every shape is timed after one untimed run anyway); on an accelerator
    # it is on, so decode runs the captured graphs a worker would run.
    engine = LLMEngine(EngineConfig(model=model, skip_warmup=device == "cpu", device=device, dtype=dtype))
    sync = engine.runner.device.synchronize
    runner, alloc, buckets = engine.runner, engine.allocator, engine.buckets
    bs = engine.block_size
    sched = engine.config.scheduler

    def make(n: int, length: int, tag: str) -> list[Request]:
        reqs = []
        for i in range(n):
            r = Request(
                f"{tag}-{i}", [(7 * i + j) % 1000 + 3 for j in range(length)], SamplingParams(max_tokens=2)
            )
            r.block_ids = alloc.allocate(-(-(length + 1) // bs))
            reqs.append(r)
        return reqs

    def free(reqs: list[Request]) -> None:
        for r in reqs:
            alloc.free(r.block_ids)
            r.block_ids = []

    prefill_samples: list[tuple[int, int, float]] = []
    shapes = sorted(
        {(b, q) for b, q, _ in buckets.prompt if b * q <= max_prefill_tokens and b in (1, 2, 4, 8, 16)},
        key=lambda s: s[0] * s[1],
    )
    # Every query length at batch 1, and a spread of batch sizes, keep the run short and the fit well posed.
    chosen = [s for s in shapes if s[0] == 1 or s[1] in (16, 64, 256) or s[0] * s[1] == max_prefill_tokens]
    for b, q in chosen:
        reqs = make(b, q, "p")
        t = _median_time(lambda reqs=reqs: runner.prefill(reqs), repeats, sync)
        free(reqs)
        prefill_samples.append((b, q, t))
        if progress:
            logger.info("prefill batch %d x %d tokens: %.1f ms", b, q, t * 1e3)

    decode_samples: list[tuple[int, int, float]] = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (16, 128, 512, 1024):
            if b * ctx > max_decode_tokens or ctx >= sched.max_model_len:
                continue
            reqs = make(b, ctx, "d")
            for r in reqs:
                r.num_computed_tokens = ctx
                r.output_token_ids = [5]
            shape = buckets.find_decode(b, sum(-(-r.num_tokens // bs) for r in reqs))
            t = _median_time(lambda reqs=reqs: runner.decode(reqs), repeats, sync)
            free(reqs)
            if shape is None:
                continue
            decode_samples.append((shape[0], shape[2], t))
            if progress:
                logger.info("decode batch %d (pad %s), %d ctx tokens each: %.1f ms", b, shape, ctx, t * 1e3)

    gbps, transfer_note = transfer_gbps()
    where = "this machine's CPU" if device == "cpu" else device
    if device == "cuda":
        where = f"cuda ({torch.cuda.get_device_name()})"
    prefill = fit_prefill(prefill_samples)
    decode = fit_decode(decode_samples)
    cost = CostModel(
        name=model,
        source=(
            f"measured on {where}: {model} model, {num_threads} torch thread(s), "
            f"{dtype}, {'eager' if device == 'cpu' else 'decode graphs'}; "
            f"{len(prefill_samples)} prefill and {len(decode_samples)} decode shapes, median of {repeats}; "
            f"{transfer_note}; transfer latency {DEFAULT_TRANSFER_LATENCY_S * 1e3:.0f} ms stated"
        ),
        **prefill,
        **decode,
        transfer_latency_s=DEFAULT_TRANSFER_LATENCY_S,
        transfer_gbps=gbps,
        kv_bytes_per_token=engine.kv_spec.bytes_per_token,
        block_size=bs,
        num_blocks=alloc.num_blocks,
        max_model_len=sched.max_model_len,
        max_num_seqs=sched.max_num_seqs,
        max_num_prefill_seqs=sched.max_num_prefill_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
    )
    extra = {
        "measurements": {
            "prefill": [{"batch": b, "query_len": q, "seconds": round(t, 6)} for b, q, t in prefill_samples],
            "decode": [{"batch": b, "num_blocks": n, "seconds": round(t, 6)} for b, n, t in decode_samples],
        },
        "fit": {
            "prefill_mean_rel_error": round(fit_error(prefill_samples, cost.prefill_s), 4),
            "decode_mean_rel_error": round(fit_error(decode_samples, cost.decode_s), 4),
        },
    }
    return cost, extra
