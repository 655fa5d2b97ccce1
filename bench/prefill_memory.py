"""``bucketserve bench prefill-memory``: what the allocator and oneDNN settings of a prefill worker cost and save.

A prefill worker runs prompts of ever-changing token counts. On CPU two things then keep growing its resident
memory (RSS) for a long while: oneDNN keeps one primitive per GEMM shape it has seen (up to
``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1024 by default), and glibc keeps the large, varied activation buffers
it has freed on its heaps instead of handing them back. Both are bounded, but the bound is high.

Each setting runs in its own child process (glibc and oneDNN read their environment once, at start): the same
prefills, one prompt at a time, with lengths drawn at random from one seed. The report gives, per setting, the
mean prefill time over the measured part of the run (its ratio to the default settings, from the same run),
and the RSS after warm-up, at the end and at its peak. ``--repeats`` runs every setting again, in a rotated
order, so the spread of each figure is in the report.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from engine.heap import trim_heap

# name -> (environment added to the child's, whether the heap is trimmed after every prefill). The glibc
# threshold sends every allocation above it to its own mmap, returned to the kernel when freed; the oneDNN capacity
# keeps 16 primitives per kind instead of 1024; a trim (``malloc_trim(0)``) hands the free pages of glibc's heaps
# back, as a worker could when its queue empties, and the next prefill faults them in again. By default the engine
# keeps glibc's heap between steps (``engine/heap.py``); any glibc malloc variable in the environment leaves glibc's
# own behaviour, which "glibc" sets (an empty tunables string changes nothing else).
SETTINGS: dict[str, tuple[dict[str, str], bool]] = {
    "default": ({}, False),
    "glibc": ({"GLIBC_TUNABLES": ""}, False),
    "onednn16": ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}, False),
    "mmap64k": ({"MALLOC_MMAP_THRESHOLD_": "65536"}, False),
    "both": ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "MALLOC_MMAP_THRESHOLD_": "65536"}, False),
    "onednn16+trim": ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}, True),
}


def register(sub) -> None:
    p = sub.add_parser(
        "prefill-memory",
        help="a prefill worker's RSS and step time under allocator / oneDNN cache settings",
    )
    p.add_argument("--model", default="default")
    p.add_argument("--prefills", type=int, default=400)
    p.add_argument(
        "--warmup", type=int, default=50, help="prefills before the step time and RSS are measured"
    )
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}"
    )
    p.add_argument("--out", default="bench/results/prefill_memory", help="report path (without extension)")
    p.set_defaults(func=run)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(args: argparse.Namespace) -> dict:
    """One setting: build the engine and run the prefills; the figures as a dict."""
    from engine.config import EngineConfig
    from engine.heap import keep_heap
    from engine.llm_engine import LLMEngine
    from engine.request import Request, SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model))
    vocab = engine.loaded.model.config.vocab_size
    rng = random.Random(args.seed)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    times_ms: list[float] = []
    rss: list[float] = []
    for i in range(args.prefills):
        n = rng.randint(args.min_len, args.max_len)
        req = Request(f"p{i}", [rng.randrange(3, vocab) for _ in range(n)], sp)
        t0 = time.perf_counter()
        engine.prefill_only([req])
        took = (time.perf_counter() - t0) * 1e3
        engine.abort(req.request_id)
        if args.trim:
            trim_heap()
        if i >= args.warmup:
            times_ms.append(took / n)
        rss.append(_rss_mib())
    engine.check_integrity()
    return {
        # What this process ran with, as the report's check that each setting reached it.
        "env_seen": {
            k: os.environ.get(k) for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "MALLOC_MMAP_THRESHOLD_")
        },
        "heap_kept": keep_heap(),  # what the engine did at its start (cached)
        "ms_per_token": statistics.fmean(times_ms),
        "rss_after_warmup_mib": rss[args.warmup - 1] if args.warmup else rss[0],
        "rss_end_mib": rss[-1],
        "rss_peak_mib": max(rss),
        # RSS at each tenth of the run: shows whether it is still climbing at the end.
        "rss_trace_mib": [round(rss[min(len(rss) - 1, k * len(rss) // 10)], 1) for k in range(1, 11)],
    }


def _run_child(args: argparse.Namespace, setting: str) -> dict:
    extra_env, trim = SETTINGS[setting]
    env = {**os.environ, **extra_env}
    cmd = [sys.executable, "-m", "bench.prefill_memory", "--child"] + (["--trim"] if trim else [])
    for key in ("model", "prefills", "warmup", "min_len", "max_len", "seed"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    from bench.report import write_report

    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        print(
            f"error: --settings: unknown {', '.join(unknown)} (known: {', '.join(SETTINGS)})", file=sys.stderr
        )
        return 2
    if "default" not in settings:
        settings.insert(0, "default")
    if args.warmup >= args.prefills:
        print("error: --warmup must be below --prefills", file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for rep in range(args.repeats):
        # Rotate the order so no setting always runs first (or last) on a machine that warms up.
        order = settings[rep % len(settings) :] + settings[: rep % len(settings)]
        for s in order:
            r = _run_child(args, s)
            runs[s].append(r)
            print(
                f"repeat {rep + 1} {s}: {r['ms_per_token']:.3f} ms/token, RSS {r['rss_after_warmup_mib']:.0f} -> "
                f"{r['rss_end_mib']:.0f} MiB (peak {r['rss_peak_mib']:.0f})",
                flush=True,
            )
    base = [r["ms_per_token"] for r in runs["default"]]
    result: dict = {"prefills": args.prefills, "warmup": args.warmup, "lengths": [args.min_len, args.max_len]}
    table = [("setting", "ms/token (spread)", "vs default", "RSS after warm-up", "RSS end", "RSS peak")]
    for s in settings:
        ms = [r["ms_per_token"] for r in runs[s]]
        # Ratio per repeat: each repeat's settings ran back to back.
        ratios = [m / b for m, b in zip(ms, base, strict=True)]
        agg = {
            "env": SETTINGS[s][0],
            "trim_after_each_prefill": SETTINGS[s][1],
            "ms_per_token": ms,
            "ratio_to_default": ratios,
            "rss_after_warmup_mib": [r["rss_after_warmup_mib"] for r in runs[s]],
            "rss_end_mib": [r["rss_end_mib"] for r in runs[s]],
            "rss_peak_mib": [r["rss_peak_mib"] for r in runs[s]],
            "rss_trace_mib": [r["rss_trace_mib"] for r in runs[s]],
            "env_seen": runs[s][0]["env_seen"],
            "heap_kept": [r["heap_kept"] for r in runs[s]],
        }
        result[s] = agg
        table.append(
            (
                s,
                f"{statistics.fmean(ms):.3f} ({min(ms):.3f}-{max(ms):.3f})",
                f"{statistics.fmean(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
                f"{statistics.fmean(agg['rss_after_warmup_mib']):.0f} MiB",
                f"{statistics.fmean(agg['rss_end_mib']):.0f} MiB",
                f"{statistics.fmean(agg['rss_peak_mib']):.0f} MiB",
            )
        )
    path = write_report(args.out, "Prefill worker memory settings", result, table)
    print(f"report: {path}")
    return 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true", required=True)
    p.add_argument("--trim", action="store_true")
    for key, default in (("model", "default"), ("prefills", 400), ("warmup", 50)):
        p.add_argument(f"--{key}", type=type(default), default=default)
    for key in ("min-len", "max-len", "seed"):
        p.add_argument(f"--{key}", type=int, required=True)
    print(json.dumps(child(p.parse_args())))


if __name__ == "__main__":
    main()
