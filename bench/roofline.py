"""``bucketserve bench roofline``: the engine's prefill and decode steps against this machine's bounds.

In one run: the memory bandwidth (a large tensor copy) and the GEMM rate (a large matmul) of this machine,
with the engine's thread count; then the engine's prefill (1x1024, 8x256 by default) and decode steps (batch
1, 8, 32, 128 at context 512), each printed with its bound and the ratio measured / bound. The machine is
measured again just before and just after each step's timed calls, and that step's bound uses the mean of those
two readings (``--no-remeasure``: the start's for every step): on a shared 2-core Xeon the copy bandwidth read
21 to 35 GB/s in runs minutes apart, so a bound read once at the start misjudged the later steps.

A prefill's bound is its FLOPs at the GEMM rate. A decode step's bound is the larger of its bytes at the
copy bandwidth (every layer weight and the LM head read once, every sequence's K and V read, the new K and V
written) and its FLOPs at the GEMM rate. The steps run through the engine's own API (``prefill_only``,
``admit_prefilled`` + ``step``), so they include input preparation and sampling, as serving does.

That bound assumes the step's arithmetic and its memory traffic overlap perfectly. A decode step runs its phases
one after the other, though: the weight GEMMs (compute-bound from a few dozen rows on) and then attention
(memory-bound: it streams the KV cache). Each decode row also reports the sum of the two phases' own bounds
(``phases`` columns), which no execution in that order can beat; at large batches the two bounds differ.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


def register(sub) -> None:
    from engine.args import add_engine_args

    p = sub.add_parser(
        "roofline", help="prefill and decode steps against the machine's bandwidth and GEMM bounds"
    )
    add_engine_args(p)
    p.add_argument("--prefill", default="1x1024,8x256", help="prefill shapes BATCHxTOKENS, comma-separated")
    p.add_argument("--decode-batches", default="1,8,32,128", help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=512, help="context length of the decode steps")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per item (median reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--no-remeasure",
        action="store_true",
        help="bound every step by the machine figures measured at the start, not by those measured around it",
    )
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    p.add_argument("--out", default="bench/results/roofline", help="report path (without extension)")
    p.set_defaults(func=run, model="small")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    layer_params: int  # parameters of the decoder layers and the final norm
    elem: int  # bytes per element (weights and KV)

    @classmethod
    def of(cls, model, elem: int) -> ModelShape:
        c = model.config
        body = sum(p.numel() for p in model.model.layers.parameters()) + sum(
            p.numel() for p in model.model.norm.parameters()
        )
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            head_dim,
            c.hidden_size,
            c.vocab_size,
            body,
            elem,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.elem

    def attention_flops(self, q_positions: list[int]) -> float:
        """QK^T and PV for queries at these 0-based positions (each attends to position + 1 keys)."""
        return 4.0 * self.layers * self.heads * self.head_dim * sum(p + 1 for p in q_positions)

    def prefill_flops(self, batch: int, tokens: int) -> float:
        dense = 2.0 * self.layer_params * batch * tokens + 2.0 * self.hidden * self.vocab * batch
        return dense + batch * self.attention_flops(list(range(tokens)))

    def decode_flops(self, batch: int, context: int) -> float:
        dense = 2.0 * (self.layer_params + self.hidden * self.vocab) * batch
        return dense + batch * self.attention_flops([context])

    def decode_bytes(self, batch: int, context: int) -> float:
        return self.weight_bytes + self.kv_bytes(batch, context)

    @property
    def weight_bytes(self) -> float:
        return (self.layer_params + self.hidden * self.vocab) * self.elem

    def kv_bytes(self, batch: int, context: int) -> float:
        return batch * (context + 2) * self.kv_bytes_per_token  # read the context, write the new token

    def phases_bound_s(self, batch: int, context: int, bandwidth: float, rate: float) -> float:
        """The weight GEMMs' bound plus attention's, each the larger of its bytes and its FLOPs."""
        dense_flops = 2.0 * (self.layer_params + self.hidden * self.vocab) * batch
        gemm = max(self.weight_bytes / bandwidth, dense_flops / rate)
        attention = max(
            self.kv_bytes(batch, context) / bandwidth, batch * self.attention_flops([context]) / rate
        )
        return gemm + attention


def _median_s(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def measure_machine(dtype, repeats: int, device: str = "cpu") -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and matmul rate (FLOP/s) of ``device``; on the CPU, on
    this process's threads. Sizes far above the caches: a 256 MiB copy and a 2048^3 product on the CPU, 1 GiB and
    8192^3 on an accelerator."""
    import torch

    from engine.linear_prepack import onednn_has

    dev = torch.device(device)
    cpu = dev.type == "cpu"

    def timed(fn) -> float:  # median seconds, the device's queue drained around each call
        def call() -> None:
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        call()
        return _median_s(call, repeats)[0]

    src = torch.ones((64 if cpu else 256) * 2**20, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    n = 2048 if cpu else 8192
    gemm_dtype = dtype
    if cpu and dtype == torch.bfloat16 and not onednn_has(dtype):
        # No bf16 GEMM on this CPU (AVX2 only): the engine widens bf16 to fp32 for the FMA units, whose fp32 rate
        # bounds it (torch's own bf16 matmul runs at a twentieth of that here).
        gemm_dtype = torch.float32
    a = torch.randn(n, n, dtype=gemm_dtype, device=dev)
    b = torch.randn(n, n, dtype=gemm_dtype, device=dev)
    mm_s = timed(lambda: a @ b)
    rates = {"matmul": 2 * n**3 / mm_s}
    if cpu and onednn_has(gemm_dtype):
        # oneDNN with a prepacked weight (what the engine's linears run on CPU) beats torch.matmul's BLAS by
        # ~2.3x on this host at fp32 accuracy: the machine's GEMM bound is the faster of the two.
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
        torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
        dnn_s, _ = _median_s(
            lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), repeats
        )
        rates["onednn_packed"] = 2 * n**3 / dnn_s
    return {
        "bandwidth_Bps": 2 * src.numel() * src.element_size() / copy_s,
        "gemm_flops": max(rates.values()),
        "gemm_source": max(rates, key=rates.get),
        "gemm_dtype": str(gemm_dtype).removeprefix("torch."),
        **{f"gemm_flops_{k}": v for k, v in rates.items()},
    }


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def time_prefill(engine, batch: int, tokens: int, repeats: int) -> list[float]:
    from engine.request import Request, SamplingParams

    vocab = engine.loaded.model.config.vocab_size
    times = []
    for rep in range(repeats + 1):  # the first call is untimed (first-touch of the cache pages, kernels)
        reqs = [
            Request(f"pf-{rep}-{i}", p, SamplingParams(max_tokens=1, ignore_eos=True))
            for i, p in enumerate(_prompts(batch, tokens, vocab, rep))
        ]
        t0 = time.perf_counter()
        engine.prefill_only(reqs)
        took = time.perf_counter() - t0
        for r in reqs:
            engine.allocator.free(engine.detach(r.request_id).block_ids)
        if rep:
            times.append(took)
    return times


def start_decoding(engine, batch: int, context: int, steps: int, prefix: str = "dc") -> list:
    """``batch`` sequences prefilled to ``context`` tokens (untimed) and handed to decode, with room for ``steps``
    full decode steps after one untimed first step (an engine that overlaps decode steps stops launching ahead a
    step before a request's last token)."""
    from engine.request import Request, SamplingParams

    vocab = engine.loaded.model.config.vocab_size
    sp = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    reqs = [
        Request(f"{prefix}-{batch}-{i}", p, sp) for i, p in enumerate(_prompts(batch, context, vocab, batch))
    ]
    chunk = max(1, engine.config.scheduler.max_num_batched_tokens // context)
    for s in range(0, batch, chunk):
        part = reqs[s : s + chunk]
        engine.prefill_only(part)
        for r in part:
            engine.admit_prefilled(engine.detach(r.request_id))
    engine.step()  # untimed first decode step
    return reqs


def finish_decoding(engine, reqs: list) -> None:
    """Abort ``reqs``, run out any step still in flight (it frees the aborted requests' blocks), check the
    block accounting."""
    for r in reqs:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def time_decode(engine, batch: int, context: int, repeats: int, around=contextlib.nullcontext) -> list[float]:
    """Wall time of ``repeats`` decode steps of ``batch`` sequences at ``context``; the timed steps run inside
    ``around()`` (a profiler, say)."""
    reqs = start_decoding(engine, batch, context, repeats)
    times = []
    with around():
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
    finish_decoding(engine, reqs)
    return times


def step_rows(
    engine,
    shape: ModelShape,
    prefill: list[tuple[int, int]],
    batches: list[int],
    context: int,
    repeats: int,
    bandwidth: float,
    rate: float,
    remeasure: Callable[[], tuple[float, float]] | None = None,
) -> list[dict]:
    """Time the engine's prefill steps (``(batch, tokens)``) and decode steps (batch sizes at ``context``); one
    report row each, against the bounds that ``bandwidth`` (bytes/s) and ``rate`` (FLOP/s) give. With
    ``remeasure`` (the machine's bandwidth and rate, measured when called), each row's bounds use instead the
    mean of the figures measured just before and just after its steps, recorded in the row: on a shared host
    whose bandwidth drifts by half within minutes, a bound read at the start says little of a step timed later."""

    def timed(fn) -> tuple[list[float], float, float, dict]:
        if remeasure is None:
            return fn(), bandwidth, rate, {}
        before = remeasure()
        times = fn()
        after = remeasure()
        figures = {
            "machine_GBps": [before[0] / 1e9, after[0] / 1e9],
            "machine_GFLOPs": [before[1] / 1e9, after[1] / 1e9],
        }
        return times, (before[0] + after[0]) / 2, (before[1] + after[1]) / 2, figures

    rows = []
    for b, t in prefill:
        flops = shape.prefill_flops(b, t)
        times, _, rate_now, machine = timed(lambda b=b, t=t: time_prefill(engine, b, t, repeats))
        rows.append(_row(f"prefill {b}x{t}", times, flops / rate_now, "gemm", flops=flops) | machine)
    for b in batches:
        flops, nbytes = shape.decode_flops(b, context), shape.decode_bytes(b, context)
        times, bw_now, rate_now, machine = timed(lambda b=b: time_decode(engine, b, context, repeats))
        mem_s, gemm_s = nbytes / bw_now, flops / rate_now
        phases_s = shape.phases_bound_s(b, context, bw_now, rate_now)
        row = _row(
            f"decode batch {b} @ {context}",
            times,
            max(mem_s, gemm_s),
            "memory" if mem_s >= gemm_s else "gemm",
            flops=flops,
            bytes=nbytes,
            memory_bound_ms=mem_s * 1e3,
            gemm_bound_ms=gemm_s * 1e3,
        )
        med = statistics.median(times)
        rows.append(
            {
                **row,
                "achieved_GBps": nbytes / med / 1e9,
                "phases_bound_ms": phases_s * 1e3,
                "ratio_phases": med / phases_s,
                **machine,
            }
        )
    return rows


def _row(step: str, times: list[float], bound_s: float, bound: str, **figures: float) -> dict:
    """One step's report row: median and spread of its times, its bound, the ratio, and what it computed."""
    med = statistics.median(times)
    row = {
        "step": step,
        "measured_ms": med * 1e3,
        "spread_ms": [min(times) * 1e3, max(times) * 1e3],
        **figures,
        "bound": bound,
        "bound_ms": bound_s * 1e3,
        "ratio": med / bound_s,
    }
    if "flops" in figures:
        row["achieved_gflops"] = figures["flops"] / med / 1e9
    return row


def _machine_cell(row: dict) -> str:
    """``before-after GB/s, before-after GFLOP/s`` of a row measured with its own machine figures, else empty."""
    if "machine_GBps" not in row:
        return ""
    (b0, b1), (g0, g1) = row["machine_GBps"], row["machine_GFLOPs"]
    return f"{b0:.1f}-{b1:.1f}, {g0:.0f}-{g1:.0f}"


def run(args: argparse.Namespace) -> None:
    import torch

    from bench.report import publish
    from engine.config import block_size_for, config_from_args
    from engine.device import get_device
    from engine.llm_engine import LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    prefill = [tuple(int(x) for x in item.split("x")) for item in args.prefill.split(",") if item]
    batches = [int(b) for b in args.decode_batches.split(",") if b]
    cfg = config_from_args(args)
    block = block_size_for(cfg, get_device(cfg.device).name)
    # Enough KV for the largest decode batch at its context (plus the timed steps) and for the largest prefill,
    # whatever the default cap.
    decode_need = max(batches, default=0) * (-(-(args.context + args.repeats + 4) // block) + 1)
    prefill_need = max((b * (-(-t // block) + 1) for b, t in prefill), default=0)
    need = max(decode_need, prefill_need) + 16
    if cfg.cache.num_blocks is None or cfg.cache.num_blocks < need:
        from dataclasses import replace

        cfg = replace(cfg, cache=replace(cfg.cache, num_blocks=need, block_size=block))
    # The machine first, in a quiet process: after the engine's first steps its thread pool may still spin
    # (OpenMP waits actively for a while), which lowered the copy bandwidth read afterwards by a third.
    from engine.config import fit_to_model
    from engine.model_loader import read_model_facts

    facts = read_model_facts(cfg.model)
    cfg = fit_to_model(cfg, facts.max_position_embeddings, facts.dtype)  # "auto" -> the checkpoint's dtype
    machine = measure_machine(getattr(torch, cfg.dtype), max(7, args.repeats))
    engine = LLMEngine(cfg)
    model = engine.loaded.model
    dtype = next(model.parameters()).dtype
    shape = ModelShape.of(model, torch.tensor([], dtype=dtype).element_size())
    bw, rate = machine["bandwidth_Bps"], machine["gemm_flops"]
    remeasure = None
    if not args.no_remeasure:

        def remeasure() -> tuple[float, float]:
            now = measure_machine(dtype, 3)
            return now["bandwidth_Bps"], now["gemm_flops"]

    rows = step_rows(engine, shape, prefill, batches, args.context, args.repeats, bw, rate, remeasure)
    result = {
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "shape_policy": getattr(engine.config, "shape_policy", "buckets"),
        "bandwidth_GBps": bw / 1e9,
        "gemm_GFLOPs": rate / 1e9,
        "gemm_source": machine["gemm_source"],
        "gemm_dtype": machine["gemm_dtype"],
        "bounds_from": "the start" if args.no_remeasure else "the machine measured around each step",
        "gemm_GFLOPs_by_source": {
            k.removeprefix("gemm_flops_"): v / 1e9 for k, v in machine.items() if k.startswith("gemm_flops_")
        },
        "rows": rows,
    }
    table = [
        (
            "step",
            "measured ms",
            "bound",
            "bound ms",
            "measured / bound",
            "phases ms",
            "measured / phases",
            "machine around it: GB/s, GFLOP/s",
        )
    ]
    table += [
        (
            r["step"],
            f"{r['measured_ms']:.2f}",
            r["bound"],
            f"{r['bound_ms']:.2f}",
            f"{r['ratio']:.2f}",
            f"{r['phases_bound_ms']:.2f}" if "phases_bound_ms" in r else "",
            f"{r['ratio_phases']:.2f}" if "ratio_phases" in r else "",
            _machine_cell(r),
        )
        for r in rows
    ]
    publish(
        args.out,
        "Roofline: engine steps against this machine's bounds",
        result,
        table,
        f"machine at the start: copy {bw / 1e9:.1f} GB/s, GEMM {rate / 1e9:.0f} GFLOP/s ({machine['gemm_source']}) "
        f"({result['dtype']}"
        + ("" if machine["gemm_dtype"] == result["dtype"] else f", GEMM in {machine['gemm_dtype']}")
        + f", {result['threads']} threads)"
        + ("" if args.no_remeasure else "; each step's bound from the machine measured around it"),
        args.json,
    )
