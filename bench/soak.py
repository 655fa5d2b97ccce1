"""``bucketserve bench soak``: hold ``bucketserve serve`` under steady load for minutes and report what a long run
shows and a short one hides: failed requests, KV blocks still in use once the load has stopped, and the resident
memory (RSS) drift of every process of the server (gateway, Ray Serve, controller, monitor, workers, Ray's own).

The server starts as a child process (a fresh one: its own Ray), the load is a workload at a fixed rate with
Poisson arrivals through the streaming client, RSS is sampled every ``--sample-s`` seconds, and drift is measured
from the first sample after ``--settle-frac`` of the run (caches and pools fill at first) to the last one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.procfs import PROC
from bench.server_process import ServerProcess, free_port, wait_healthy

# The rate at 80% SLO attainment measured for the default serve on this 2-core machine with the `mixed` workload
# (bench/reports, `bench sweep`): a soak runs at 80% of it unless told otherwise.
MEASURED_80PCT_RATE = 0.75


def register(sub) -> None:
    p = sub.add_parser(
        "soak", help="minutes of steady load: failures, leaked KV blocks, RSS drift per process"
    )
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument(
        "--rate",
        type=float,
        default=round(0.8 * MEASURED_80PCT_RATE, 3),
        help=f"requests per second (default: 80%% of the measured 80%%-attainment rate, {MEASURED_80PCT_RATE})",
    )
    p.add_argument("--model", default="default")
    p.add_argument("--workload", default="mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-s", type=float, default=15.0, help="seconds between RSS samples")
    p.add_argument("--settle-frac", type=float, default=0.1, help="share of the run before drift is measured")
    p.add_argument("--serve-args", default="", help="extra flags for bucketserve serve")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default="bench/results/soak", help="report path (without extension)")
    p.add_argument("--json", action="store_true", help="print only the final JSON line")
    p.set_defaults(func=run)


def _label(pid: int) -> str | None:
    """What the process is: Ray sets its workers' titles (``ray::DecodeWorker``...), the rest by command."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [a.decode(errors="replace") for a in argv if a]
    if not words:
        return None
    first = words[0].split()[0]
    if first.startswith("ray::"):
        return first.split(".")[0]  # without the method it is running now (ray::DecodeWorker.drain)
    if "-m" in words:  # python -m module ...
        i = words.index("-m")
        return " ".join(words[i + 1 : i + 3])
    name = Path(first).name
    script = next((Path(w).name for w in words[1:] if w.endswith(".py")), None)
    return f"{name} {script}" if script and name.startswith("python") else name


# RSS and its parts (/proc/PID/status): anonymous memory (heaps, allocator caches) is where a leak would show;
# shared memory is mostly the KV cache, whose pages count once first touched, so it grows up to the cache's size.
_RSS_FIELDS = {"VmRSS:": 0, "RssAnon:": 1, "RssShmem:": 2}


def _rss_kib(pid: int) -> tuple[int, int, int] | None:
    """(RSS, anonymous, shared memory) in KiB; None when the process is gone."""
    parts = [0, 0, 0]
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            key = line.split(maxsplit=1)[0] if line else ""
            if key in _RSS_FIELDS:
                parts[_RSS_FIELDS[key]] = int(line.split()[1])
    except OSError:
        return None
    return parts[0], parts[1], parts[2]


def sample_rss(server: ServerProcess) -> dict[int, tuple[str, int, int, int]]:
    """pid -> (label, RSS, anonymous, shared memory; KiB) of every live process of the server's session."""
    out = {}
    for pid in server.members():
        label, rss = _label(pid), _rss_kib(pid)
        if label is not None and rss is not None:
            out[pid] = (label, *rss)
    return out


def drift_rows(
    first: dict[int, tuple[str, int, int, int]], last: dict[int, tuple[str, int, int, int]]
) -> list[dict[str, Any]]:
    """Per process alive in both samples: RSS at each, the change in percent, and the change of its anonymous and
    shared-memory parts."""
    rows = []
    for pid in sorted(set(first) & set(last), key=lambda p: first[p][0]):
        label, a, anon_a, shm_a = first[pid]
        _, b, anon_b, shm_b = last[pid]
        rows.append(
            {
                "pid": pid,
                "process": label,
                "rss_first_mib": round(a / 1024, 1),
                "rss_last_mib": round(b / 1024, 1),
                "drift_pct": round(100.0 * (b - a) / a, 2) if a else None,
                "anon_change_mib": round((anon_b - anon_a) / 1024, 1),
                "shmem_change_mib": round((shm_b - shm_a) / 1024, 1),
            }
        )
    return rows


_USAGE = re.compile(r'^bucketserve:kv_cache_usage_perc\{[^}]*worker_id="([^"]+)"[^}]*\}\s+(\S+)', re.M)


def kv_usage(base: str) -> dict[str, float]:
    """Each worker's KV cache usage (1 = full) from ``/metrics``."""
    text = httpx.get(base + "/metrics", timeout=30).text
    return {w: float(v) for w, v in _USAGE.findall(text)}


def wait_kv_idle(base: str, timeout_s: float = 60.0) -> dict[str, float]:
    """Usage per worker once every worker reports none in use, or as it stands at the timeout (a leak)."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage = kv_usage(base)
        if (usage and not any(usage.values())) or time.monotonic() > deadline:
            return usage
        time.sleep(1.0)


async def _load(base: str, args: argparse.Namespace, server: ServerProcess, samples: list) -> Any:
    from bench.client import run_benchmark
    from bench.serve import _model_max_len
    from bench.workload_requests import make_requests
    from bench.workloads import load_alpaca_texts
    from engine.model_loader import load_tokenizer

    n = max(1, math.ceil(args.rate * args.minutes * 60))
    texts = load_alpaca_texts(Path(__file__).parent / "data" / "alpaca_seed_tasks.jsonl")
    requests = make_requests(
        args.workload,
        n,
        args.rate,
        load_tokenizer(args.model),
        seed=args.seed,
        max_model_len=min(_model_max_len(args.model), 2048),
        max_output_len=256,
        alpaca_texts=texts if args.workload in ("alpaca", "mixed") else None,
    )
    done = asyncio.Event()

    async def sampler() -> None:
        while not done.is_set():
            samples.append((time.monotonic(), sample_rss(server)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), args.sample_s)

    task = asyncio.ensure_future(sampler())
    try:
        return await run_benchmark(base, requests, model=args.model, progress=False, request_rate=args.rate)
    finally:
        done.set()
        await task
        samples.append((time.monotonic(), sample_rss(server)))


def run(args: argparse.Namespace) -> int:
    from bench.report import write_report

    if not args.minutes > 0 or not args.rate > 0 or not args.sample_s > 0 or not 0 <= args.settle_frac < 1:
        print("error: --minutes, --rate and --sample-s must be > 0, --settle-frac in [0, 1)", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", args.model, "--port", str(port)]
    cmd += shlex.split(args.serve_args)
    out = Path(args.out)
    server = ServerProcess(cmd, {}, out.with_suffix(".serve.log"))
    base = f"http://127.0.0.1:{port}"
    samples: list[tuple[float, dict[int, tuple[str, int, int, int]]]] = []
    try:
        wait_healthy(base, server, args.startup_timeout_s)
        t0 = time.monotonic()
        result = asyncio.run(_load(base, args, server, samples))
        usage = wait_kv_idle(base)
        alive_after = server.alive()
    finally:
        left = server.stop()
    settle_at = t0 + args.settle_frac * (samples[-1][0] - t0)
    first = next((s for t, s in samples if t >= settle_at), samples[-1][1])
    rows = drift_rows(first, samples[-1][1])
    summary = result.summary()
    worst = max((r for r in rows if r["drift_pct"] is not None), key=lambda r: r["drift_pct"], default=None)
    report = {
        "minutes": args.minutes,
        "rate": args.rate,
        "workload": args.workload,
        "model": args.model,
        "requests": summary["num_requests"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "slo_attainment": summary["slo_attainment"],
        "kv_usage_after": usage,
        "leaked_kv": any(usage.values()) or not usage,
        "server_alive_at_end": alive_after,
        "processes_left_after_stop": len(left),
        "rss_samples": len(samples),
        "max_drift_pct": None if worst is None else worst["drift_pct"],
        "max_drift_process": None if worst is None else worst["process"],
        "rss": rows,
        # Every sample of every process that lived to the end, [seconds into the load, MiB]: a plateau is a cache
        # filling, a steady climb a leak.
        "rss_series": {
            f"{label} ({pid})": [
                [round(t - t0, 1), round(sample[pid][1] / 1024, 1)] for t, sample in samples if pid in sample
            ]
            for pid, (label, *_) in samples[-1][1].items()
        },
        "load": summary,
    }
    table = [("process", "pid", "RSS first (MiB)", "RSS last (MiB)", "drift %", "of it: anon", "shmem")]
    table += [
        (
            r["process"],
            str(r["pid"]),
            str(r["rss_first_mib"]),
            str(r["rss_last_mib"]),
            str(r["drift_pct"]),
            f"{r['anon_change_mib']:+}",
            f"{r['shmem_change_mib']:+}",
        )
        for r in rows
    ]
    path = write_report(
        out, f"Soak: {args.minutes:g} min at {args.rate:g} req/s ({args.workload})", report, table
    )
    if not args.json:
        print(
            f"{report['completed']}/{report['requests']} completed, {report['failed']} failed, "
            f"KV in use after: {usage}, largest RSS drift {report['max_drift_pct']}% ({report['max_drift_process']})"
        )
        print(f"report: {path}, {path.with_suffix('.md')}")
    print(json.dumps({k: v for k, v in report.items() if k not in ("rss", "rss_series", "load")}))
    return 0 if report["failed"] == 0 and not report["leaked_kv"] else 1
