"""``bucketserve bench fused-attention``: decode steps with the attention layers fused against the same engine
without them, paired step by step; with ``--part stack``, the direct walk through the decoder layers
(``engine/decoder_stack.py``) against the model's own forward over the same fused layers; with ``--part
native-stack``, that walk in C++ (``bucketserve_cpu::decoder_layers``) against the same walk in Python.

Two engines in one process, one with the part skipped at load (``attention``: transformers' attention forward,
and so no decoder stack either, which needs the fused layers; ``stack``: the fused layers called through the
model's forward; ``native-stack``: the Python walk), one with it, each holding the same batch of sequences at the
same context; they step in turn (which one goes first alternates), so both see the same moments of a shared
host's noise, and each pair of steps gives one ratio. Reported per batch size: both engines' median step times
and the median ratio fused / unfused with its quartiles. fp32 outputs must be identical token for token
(checked).
"""

from __future__ import annotations

import argparse
import statistics
import time


def register(sub) -> None:
    from engine.args import add_engine_args

    p = sub.add_parser(
        "fused-attention", help="decode steps with fused attention layers against without, paired"
    )
    add_engine_args(p)
    p.add_argument(
        "--part",
        choices=sorted(PARTS),
        default="attention",
        help="what the baseline engine skips: the fused attention layers (and so the decoder stack), only "
        "the decoder stack, or only its C++ walk",
    )
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=512, help="context length at the first timed step")
    p.add_argument("--steps", type=int, default=100, help="timed step pairs per batch size")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    p.add_argument("--out", default="bench/results/fused_attention", help="report path (without extension)")
    p.set_defaults(func=run, model="small")


# --part: the engine-loading step the baseline skips (module, function), and what it returns when skipped.
PARTS = {
    "attention": ("engine.llm_engine", "fuse_attention_layers", 0),
    "stack": ("engine.llm_engine", "decoder_stack", None),
    "native-stack": ("engine.kernels.build", "load_decoder_stack", None),
}


def _engines(cfg, part: str = "attention"):
    import importlib

    import engine.llm_engine as llm_engine

    module, name, skipped = PARTS[part]
    owner = importlib.import_module(module)
    step = getattr(owner, name)
    setattr(owner, name, lambda *args: skipped)
    try:
        plain = llm_engine.LLMEngine(cfg)
    finally:
        setattr(owner, name, step)
    return plain, llm_engine.LLMEngine(cfg)


def paired_steps(plain, fused, batch: int, context: int, steps: int) -> dict:
    from bench.roofline import finish_decoding, start_decoding

    ra, rb = (start_decoding(e, batch, context, steps, prefix="fa") for e in (plain, fused))
    times: dict[str, list[float]] = {"unfused": [], "fused": []}
    for i in range(steps):
        order = [("unfused", plain), ("fused", fused)]
        for name, engine in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t0)
    same = [r.output_token_ids for r in ra] == [r.output_token_ids for r in rb]
    finish_decoding(plain, ra)
    finish_decoding(fused, rb)
    ratios = [f / u for u, f in zip(times["unfused"], times["fused"], strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "batch": batch,
        "unfused_ms": statistics.median(times["unfused"]) * 1e3,
        "fused_ms": statistics.median(times["fused"]) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_quartiles": [q1, q3],
        "identical_tokens": same,
    }


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from bench.report import publish
    from engine.config import block_size_for, config_from_args
    from engine.device import get_device

    batches = [int(b) for b in args.batches.split(",") if b]
    cfg = config_from_args(args)
    block = block_size_for(cfg, get_device(cfg.device).name)
    need = max(batches) * (-(-(args.context + args.steps + 16) // block) + 1) + 16
    if cfg.cache.num_blocks is None or cfg.cache.num_blocks < need:
        cfg = replace(cfg, cache=replace(cfg.cache, num_blocks=need, block_size=block))
    plain, fused = _engines(cfg, args.part)
    if plain.config.shape_policy != "flat" or plain.device.name != "cpu" or plain.config.compile:
        raise SystemExit("bench fused-attention: the fusion applies to eager flat steps on the CPU only")
    rows = [paired_steps(plain, fused, b, args.context, args.steps) for b in batches]
    dtype = plain.config.dtype
    if dtype == "float32" and not all(r["identical_tokens"] for r in rows):
        raise SystemExit("bench fused-attention: fp32 tokens differ between the fused and unfused engines")
    table = [("batch", "unfused ms", "fused ms", "fused / unfused (median of pairs)", "quartiles")]
    table += [
        (
            str(r["batch"]),
            f"{r['unfused_ms']:.2f}",
            f"{r['fused_ms']:.2f}",
            f"{r['ratio']:.3f}",
            f"{r['ratio_quartiles'][0]:.3f}-{r['ratio_quartiles'][1]:.3f}",
        )
        for r in rows
    ]
    result = {
        "model": args.model,
        "dtype": dtype,
        "part": args.part,
        "context": args.context,
        "steps": args.steps,
        "rows": rows,
    }
    title = {
        "attention": "Fused attention layers",
        "stack": "Decoder stack",
        "native-stack": "Decoder stack walked in C++",
    }[args.part]
    publish(
        args.out,
        f"{title}: paired decode steps (fused: with it; unfused: without)",
        result,
        table,
        f"{args.model}, {dtype}, context {args.context}, {args.steps} step pairs per batch",
        args.json,
    )
    return 0
