"""Bucketing benchmark: padding waste of adaptive request buckets, and scheduling cost as the queue grows.

Run: ``python -m bench.bucketing [--json] [--out bench/results/bucketing]``.

Padding waste (padded tokens / real tokens, in the query dimension) on the ``mixed`` workload:

* ``static``: one bucket -- every prompt padded to ``max_model_len``;
* ``pow2``: fixed power-of-two buckets -- every prompt padded to the next power of two;
* ``adaptive``: the bucket manager -- request buckets split and merged by Algorithm 1 (capacity from the memory
  budget), batches formed by ``plan_batch`` and padded to the longest prompt's warmed shape; run with everything
  queued at once and with a shallow queue refilled as batches leave. The batch-dimension padding of the warmed
  shape is reported separately.

Scheduling cost: with N requests queued (kept at N by adding one for each one scheduled), the wall time per
scheduled request of ``adjust`` + ``plan_batch`` + removal + assignment of the replacements. The paper's
assignment by scanning every bucket is timed beside the binary search.
"""

from __future__ import annotations

import argparse
import bisect
import json
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.workloads import sample_lengths
from bucket_manager.batch_plan import plan_batch
from bucket_manager.memory_budget import MemoryBudget
from bucket_manager.priority import PriorityPolicy
from bucket_manager.request import PriorityClass, RequestSummary
from bucket_manager.request_buckets import RequestBuckets
from bucket_manager.shape_buckets import ShapeBucketConfig, ShapeBuckets

DEFAULT_OUT = "bench/results/bucketing"
QUEUE_SIZES = (100, 10_000, 100_000)


def _requests(lengths: Sequence[tuple[int, int]], start: int = 0) -> list[RequestSummary]:
    # Alternate classes so both orders and the starvation guard are exercised; arrivals 1 ms apart.
    return [
        RequestSummary(
            f"r{start + i}",
            inp,
            out,
            PriorityClass.ONLINE if (start + i) % 2 else PriorityClass.OFFLINE,
            arrival=(start + i) * 0.001,
        )
        for i, (inp, out) in enumerate(lengths)
    ]


def _setup(args: argparse.Namespace) -> tuple[ShapeBuckets, MemoryBudget, PriorityPolicy]:
    shapes = ShapeBuckets(
        ShapeBucketConfig.from_serving(
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_prefill_seqs=args.max_num_prefill_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            env={},
        )
    )
    budget = MemoryBudget(
        block_size=args.block_size,
        prefill_free_blocks=args.free_blocks,
        decode_free_blocks=args.free_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    return shapes, budget, PriorityPolicy()


def _capacity(requests: Sequence[RequestSummary], budget: MemoryBudget, shapes: ShapeBuckets) -> int:
    mean_in = sum(r.prompt_len for r in requests) / len(requests)
    mean_out = sum(r.max_tokens for r in requests) / len(requests)
    return budget.capacity(mean_in, mean_out, shapes.max_prompt_batch_size)


def _drain(
    pending: list[RequestSummary],
    depth: int,
    shapes: ShapeBuckets,
    budget: MemoryBudget,
    policy: PriorityPolicy,
) -> dict:
    """Schedule every request, keeping at most ``depth`` queued; padding totals over all batches."""
    queue = RequestBuckets(shapes.config.max_model_len, shapes.prompt_query_lens, key=policy.key)
    n_cap = _capacity(pending, budget, shapes)
    feed = iter(pending)
    real = seq_pad = shape_pad = batches = 0
    now, streak, left = 0.0, 0, len(pending)
    while left:
        while len(queue) < depth and (r := next(feed, None)) is not None:
            queue.add(r)
        queue.adjust(n_cap)
        plan = plan_batch(queue, shapes, budget, policy, now=now, online_streak=streak)
        if plan is None or plan.shape is None:
            raise RuntimeError("benchmark memory figures must fit every request")
        batch_real = plan.real_tokens
        real += batch_real
        seq_pad += len(plan.request_ids) * plan.shape[1] - batch_real
        shape_pad += plan.padded_tokens
        batches += 1
        queue.remove_many(plan.request_ids)
        left -= len(plan.request_ids)
        streak = 0 if plan.priority_class is PriorityClass.OFFLINE else streak + 1
        now += 0.05
    return {
        "waste_ratio": seq_pad / real,
        "waste_ratio_with_batch_padding": shape_pad / real,
        "batches": batches,
        "mean_batch_size": len(pending) / batches,
        "n_max": n_cap,
    }


def padding_waste(args: argparse.Namespace) -> dict:
    shapes, budget, policy = _setup(args)
    lengths = sample_lengths("mixed", args.requests, args.seed, max_model_len=args.max_model_len)
    requests = _requests(lengths)
    real = sum(r.prompt_len for r in requests)
    static = sum(args.max_model_len - r.prompt_len for r in requests) / real
    pow2 = sum((1 << (r.prompt_len - 1).bit_length()) - r.prompt_len for r in requests) / real
    return {
        "workload": "mixed",
        "requests": len(requests),
        "mean_prompt_len": real / len(requests),
        "static_one_bucket": {"waste_ratio": static, "buckets": 1},
        "pow2_buckets": {"waste_ratio": pow2, "buckets": args.max_model_len.bit_length()},
        "adaptive_all_queued": _drain(requests, len(requests), shapes, budget, policy),
        "adaptive_queue_64": _drain(requests, 64, shapes, budget, policy),
        "warmed_query_lens": shapes.prompt_query_lens,
    }


def _time_assignment(queue: RequestBuckets, lengths: Sequence[int]) -> tuple[float, float]:
    bounds = queue.bounds()
    lows = [lo for lo, _ in bounds]
    t0 = time.perf_counter()
    for n in lengths:
        bisect.bisect_right(lows, n)
    t1 = time.perf_counter()
    for n in lengths:
        # The paper's assignment: test every bucket in turn.
        next(i for i, (lo, up) in enumerate(bounds) if lo <= n < up)
    t2 = time.perf_counter()
    return (t1 - t0) / len(lengths) * 1e6, (t2 - t1) / len(lengths) * 1e6


def scheduling_cost(args: argparse.Namespace, queued: int) -> dict:
    shapes, budget, policy = _setup(args)
    rounds_requests = args.scheduled
    lengths = sample_lengths(
        "mixed", queued + rounds_requests + 64, args.seed + queued, max_model_len=args.max_model_len
    )
    initial = _requests(lengths[:queued])
    spare = _requests(lengths[queued:], start=queued)
    queue = RequestBuckets(args.max_model_len, shapes.prompt_query_lens, key=policy.key)
    for r in initial:
        queue.add(r)
    n_cap = _capacity(initial, budget, shapes)
    while queue.adjust(n_cap):  # reach the split state a long-running queue would be in
        pass
    feed = iter(spare)
    scheduled = 0
    now, streak = queued * 0.001, 0
    t0 = time.perf_counter()
    while scheduled < rounds_requests:
        queue.adjust(n_cap)
        plan = plan_batch(queue, shapes, budget, policy, now=now, online_streak=streak)
        if plan is None:
            raise RuntimeError("benchmark memory figures must fit every request")
        queue.remove_many(plan.request_ids)
        for _ in plan.request_ids:
            queue.add(next(feed))
        scheduled += len(plan.request_ids)
        streak = 0 if plan.priority_class is PriorityClass.OFFLINE else streak + 1
        now += 0.05
    elapsed = time.perf_counter() - t0
    bisect_us, scan_us = _time_assignment(queue, [n for n, _ in lengths[:20_000]])
    return {
        "queued": queued,
        "scheduled": scheduled,
        "us_per_request": elapsed / scheduled * 1e6,
        "request_buckets": queue.num_buckets,
        "assign_bisect_us": bisect_us,
        "assign_scan_us": scan_us,
    }


def _markdown(command: str, result: dict) -> str:
    pad = result["padding"]
    lines = [
        "# Bucketing benchmark",
        "",
        f"Command: `{command}`",
        "",
        f"Padding waste on `mixed` ({pad['requests']} requests, mean prompt {pad['mean_prompt_len']:.0f} tokens, "
        f"max_model_len {result['config']['max_model_len']}): padded tokens / real tokens in the query dimension.",
        "",
        "| bucketing | waste ratio | with batch padding | batches | mean batch |",
        "|---|---|---|---|---|",
        f"| one static bucket | {pad['static_one_bucket']['waste_ratio']:.3f} | | | |",
        f"| power-of-two buckets | {pad['pow2_buckets']['waste_ratio']:.3f} | | | |",
    ]
    for name in ("adaptive_all_queued", "adaptive_queue_64"):
        a = pad[name]
        lines.append(
            f"| {name.replace('_', ' ')} | {a['waste_ratio']:.3f} | {a['waste_ratio_with_batch_padding']:.3f} "
            f"| {a['batches']} | {a['mean_batch_size']:.1f} |"
        )
    lines += [
        "",
        "Scheduling cost (adjust + plan + remove + assign the replacements), per scheduled request:",
        "",
        "| queued | µs / request | request buckets | assign: binary search µs | assign: scan µs |",
        "|---|---|---|---|---|",
    ]
    for c in result["cost"]:
        lines.append(
            f"| {c['queued']:,} | {c['us_per_request']:.2f} | {c['request_buckets']} "
            f"| {c['assign_bisect_us']:.3f} | {c['assign_scan_us']:.3f} |"
        )
    env = result["environment"]
    lines += ["", f"Environment: Python {env['python']} on {env['machine']}, {env['time']}.", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.bucketing", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", default=DEFAULT_OUT, help="report path without extension (.json and .md are written)"
    )
    p.add_argument("--json", action="store_true", help="print the JSON result as the last line")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=4096, help="requests in the padding experiment")
    p.add_argument("--scheduled", type=int, default=20_000, help="requests scheduled per queue size timed")
    p.add_argument("--queue-sizes", default=",".join(str(n) for n in QUEUE_SIZES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-prefill-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--free-blocks", type=int, default=8192, help="free KV blocks on each worker")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    command = " ".join(["python -m bench.bucketing", *(shlex.quote(a) for a in argv)])
    sizes = [int(s) for s in args.queue_sizes.split(",") if s]
    result = {
        "command": command,
        "config": {
            k: getattr(args, k)
            for k in (
                "seed",
                "block_size",
                "max_model_len",
                "max_num_prefill_seqs",
                "max_num_batched_tokens",
                "free_blocks",
            )
        },
        "padding": padding_waste(args),
        "cost": [scheduling_cost(args, n) for n in sizes],
        "environment": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
    }
    base = Path(args.out)
    base = base.with_suffix("") if base.suffix in (".json", ".md") else base
    base.parent.mkdir(parents=True, exist_ok=True)
    base.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    base.with_suffix(".md").write_text(_markdown(command, result))
    print(_markdown(command, result))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
