"""``bucketserve bench latency``: start each system's server as a child process, time it to a healthy
``/health``, then measure TTFT and TPOT of one request at a time and of a burst of concurrent requests; SIGINT
it at the end.

Systems: our ``serve`` in each mode (disaggregated, colocated) and vLLM's ``vllm serve`` of the same checkpoint
(its CPU build, from its own virtual environment), one after the other in this run. Each gets a fresh server, so
start-up includes model load and warm-up (and, for ours, Ray) exactly as a user sees them. Prompts are token ids (fixed length) with ``ignore_eos``, so every request makes
exactly ``--output-len`` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.report import write_report
from bench.server_process import ServerProcess, free_port, wait_healthy


def register(sub) -> None:
    p = sub.add_parser("latency", help="time to healthy, TTFT/TPOT single and concurrent, per system")
    p.add_argument(
        "--systems",
        "--modes",
        dest="systems",
        default="disaggregated,colocated",
        help="comma-separated: our serving modes (disaggregated, colocated) and/or vllm",
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("BUCKETSERVE_VLLM_PYTHON", "/tmp/vllm-cpu-venv/bin/python"),
        help="Python of the virtual environment with vLLM's CPU build (system vllm)",
    )
    p.add_argument("--max-model-len", type=int, default=2048, help="both systems' max_model_len")
    p.add_argument("--model", default="default")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--single-runs", type=int, default=5, help="sequential single requests (median reported)")
    p.add_argument("--concurrency", type=int, default=32, help="requests sent at once in the burst")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.add_argument("--serve-args", default="", help="extra flags for bucketserve serve, e.g. '--skip-warmup'")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also read, from our servers' monitor, where the single requests' time to first token went, "
        "stage by stage (admission, controller queue, prefill queue, prefill forward, first token out; the "
        "KV hand-off; the overhead: TTFT less the prefill forward)",
    )
    p.add_argument(
        "--report", default=None, help="also write the results here (JSON, and Markdown beside it)"
    )
    p.add_argument("--json", action="store_true", help="print only the final JSON")
    p.set_defaults(func=run)


async def _one(c: httpx.AsyncClient, model: str, prompt: list[int], n: int) -> dict[str, float]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    times: list[float] = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("no token came back")
    # Text chunks, not tokens: TPOT spreads the time after the first chunk over the remaining tokens.
    return {"ttft_ms": (times[0] - t0) * 1e3, "tpot_ms": (times[-1] - times[0]) * 1e3 / max(1, n - 1)}


def _summary(rows: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in ("ttft_ms", "tpot_ms"):
        vals = sorted(r[key] for r in rows)
        out[f"{key}_median"] = round(statistics.median(vals), 1)
        out[f"{key}_p90"] = round(vals[min(len(vals) - 1, int(0.9 * len(vals)))], 1)
    return out


async def _stages(c: httpx.AsyncClient, n: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """The server's per-stage figures once its monitor holds the ``n`` requests sent so far (each is recorded as it
    ends, without the response waiting on it). The server is fresh, so its window holds exactly those."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = await c.get("/dashboard/data", params={"window_s": 900})
        r.raise_for_status()
        stages = r.json().get("stages", {})
        if stages.get("prefill_forward", {}).get("count", 0) >= n:
            return stages
        if time.monotonic() > deadline:
            raise RuntimeError(f"the monitor holds stages of {stages.get('prefill_forward')} of {n} requests")
        await asyncio.sleep(0.2)


async def _measure(base: str, args: argparse.Namespace, breakdown: bool = False) -> dict[str, Any]:
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(10, 1000) for _ in range(args.prompt_len)]

    limits = httpx.Limits(max_connections=args.concurrency + 4)
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as c:
        single = [await _one(c, args.model, prompt(), args.output_len) for _ in range(args.single_runs)]
        if breakdown:
            out["single_stages"] = await _stages(c, args.single_runs)
        t0 = time.perf_counter()
        burst = await asyncio.gather(
            *(_one(c, args.model, prompt(), args.output_len) for _ in range(args.concurrency))
        )
        wall = time.perf_counter() - t0
    return {
        "single": _summary(single),
        **out,
        f"concurrent_{args.concurrency}": {
            **_summary(burst),
            "output_tok_s": round(args.concurrency * args.output_len / wall, 1),
        },
    }


def _command(system: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    if system == "vllm":
        from bench.sweep_systems import system_command

        if not Path(args.vllm_python).exists():
            raise SystemExit(f"bench latency: no vLLM environment at {args.vllm_python} (pass --vllm-python)")
        return system_command("vllm", args, port)
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--mode", system, "--model", args.model]
    cmd += ["--port", str(port), "--max-model-len", str(args.max_model_len)]
    return cmd + args.serve_args.split(), {}


def _run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    cmd, env = _command(mode, args, port)
    with tempfile.TemporaryDirectory(prefix="bucketserve-latency-") as logs:
        server = ServerProcess(cmd, env, Path(logs) / "serve.log")
        try:
            healthy_s = wait_healthy(base, server, args.startup_timeout_s, poll_s=0.2)
            result = {
                "system": mode,
                "time_to_healthy_s": round(healthy_s, 1),
                **asyncio.run(_measure(base, args, args.breakdown and mode != "vllm")),
            }
        finally:
            t1 = time.perf_counter()
            server.stop(grace_s=120.0)  # SIGINT first: what Ctrl-C does
            rc = server.proc.returncode
    result["sigint_exit_code"] = rc
    result["shutdown_s"] = round(time.perf_counter() - t1, 1)
    return result


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the figures
    results = []
    for mode in [m.strip() for m in args.systems.split(",") if m.strip()]:
        res = _run_mode(mode, args)
        results.append(res)
        if not args.json:
            print(json.dumps(res), flush=True)
    report = {
        "model": args.model,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "single_runs": args.single_runs,
        "cpus": os.cpu_count(),
        "results": results,
    }
    if args.report:
        title = f"Latency: {args.model}, {args.prompt_len}-token prompts, {args.output_len} tokens out"
        write_report(args.report, title, report, _table(report))
    print(json.dumps(report))
    return 0


def _table(report: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per system: TTFT and TPOT of single requests and of the burst; then, where measured, one row per
    stage of a single request's way (monitor/stages.py), in the order a request passes them."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    rows: list[tuple[str, ...]] = [("system", "what", "requests", "mean (ms)", "p50 (ms)", "p90 (ms)")]
    for r in report["results"]:
        single = r["single"]
        n = str(report.get("single_runs", ""))
        rows.append(
            (r["system"], "TTFT, single", n, "-", ms(single["ttft_ms_median"]), ms(single["ttft_ms_p90"]))
        )
        rows.append(
            (r["system"], "TPOT, single", n, "-", ms(single["tpot_ms_median"]), ms(single["tpot_ms_p90"]))
        )
        for name, st in r.get("single_stages", {}).items():
            rows.append(
                (
                    r["system"],
                    f"stage {name}",
                    f"{st['count']:g}",
                    ms(st["mean_ms"]),
                    ms(st["p50_ms"]),
                    ms(st["p90_ms"]),
                )
            )
        for key, burst in r.items():
            if key.startswith("concurrent_"):
                rows.append(
                    (
                        r["system"],
                        f"TTFT, {key}",
                        key.split("_")[1],
                        "-",
                        ms(burst["ttft_ms_median"]),
                        ms(burst["ttft_ms_p90"]),
                    )
                )
    return rows
