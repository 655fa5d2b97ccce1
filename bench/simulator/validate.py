"""Validation: simulated vs measured SLO attainment on this machine (``bucketserve simulate --validate``).

Starts ``bucketserve serve`` (one prefill and one decode worker, or the workers given) on the calibrated model,
waits for ``/health``, runs ``bucketserve bench serve`` at each rate (same workload, seed, prompt count, SLOs and
length limits as the simulation), stops the cluster, and simulates the same requests with the calibration. It
reports, per rate, both attainments and their difference in points.

What the engine calibration does not know is measured on the running cluster before the rates, with other
requests than the ones compared (seed + 1):

* host contention (:mod:`bench.simulator.host`): the cluster's processes are read from ``/proc`` while idle
  (background CPU of Ray and the gateway, taken off the cores) and under a calibration load at
  ``--calibration-rate``: the CPU the host side (gateway, proxy, controller, Ray, and the client's own
  ``client_cpu_s``) spends per streamed token, and each worker's CPU per second of simulated engine time
  (found by fixed point: the simulation of the calibration load says how much engine time it ran);
* fixed latency of the serving path: a few requests far apart (the probe); the median over its requests
  (but the first, which meets cold code paths) of measured less simulated TTFT is the per-request overhead.

Three simulations are reported: "simulated" (contention model + overhead), "idle probe" (the earlier method:
every engine cost scaled by the ratio of measured to simulated idle TPOT, plus the overhead; it knows nothing
of load) and "engine only" (the bare calibration).

``--measured DIR`` re-analyses the bench reports of an earlier run (``probe.json``, ``calibration.json``,
``cpu.json``, ``rate_<R>.json`` with the rate's dot written ``_``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.server_process import ServerProcess, wait_healthy
from bench.simulator.cost_model import REPORTS_DIR, CostModel, load_cost
from bench.simulator.host import HostModel
from bench.simulator.proc_cpu import cluster_cpu, process_cpu
from bench.simulator.sim import SimConfig, simulate
from bucket_manager.priority import PriorityPolicy

REPO_ROOT = Path(__file__).resolve().parents[2]
HEALTH_TIMEOUT_S = 600.0
PROBE_PROMPTS = 9
PROBE_RATE = 0.25
IDLE_S = 10.0  # idle window for the cluster's background CPU
FIXED_POINT_ROUNDS = 4


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", *args]


def start_cluster(
    model: str,
    port: int,
    prefill: int,
    decode: int,
    log: Path,
    warmup: bool = False,
    online_order: str = "arrival",
    late_last: str = "on",
) -> ServerProcess:
    cmd = _cli(
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--prefill-workers",
        str(prefill),
        "--decode-workers",
        str(decode),
        "--online-order",
        online_order,
        "--late-last",
        late_last,
        # The name the benchmark client sends (the server would otherwise name an alias by what it stands for).
        "--served-model-name",
        model,
    )
    if not warmup:
        # On CPU, warm-up only runs each shape once (no graphs without --compile); the calibration ran without
        # it too, and warming 144 shapes of the small model takes minutes on a shared 2-core machine.
        cmd.append("--skip-warmup")
    server = ServerProcess(cmd, {}, log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server, HEALTH_TIMEOUT_S, poll_s=2.0)
    except BaseException:
        # Interrupted or failed while starting: the caller has no handle yet, so stop it here.
        server.stop()
        raise
    return server


def bench_point(
    args: argparse.Namespace, rate: float, num: int, out: Path, max_model_len: int, seed: int | None = None
) -> dict[str, Any]:
    cmd = _cli(
        "bench",
        "serve",
        "--base-url",
        f"http://127.0.0.1:{args.port}",
        "--model",
        args.model,
        "--workload",
        args.workload,
        "--request-rate",
        str(rate),
        "--num-prompts",
        str(num),
        "--seed",
        str(args.seed if seed is None else seed),
        "--slo-ttft-ms",
        str(args.slo_ttft_ms),
        "--slo-tpot-ms",
        str(args.slo_tpot_ms),
        "--max-model-len",
        str(max_model_len),
        "--max-output-len",
        str(args.max_output_len),
        "--out",
        str(out),
        "--no-progress",
        "--json",
    )
    load_before = os.getloadavg()[0]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"bench serve failed ({done.returncode}): {done.stderr[-2000:]}")
    point = json.loads(lines[-1])
    # The machine's 1-minute load around the point: on a shared machine it explains much of the measurement.
    point["load_1min"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
    return point


def _point_name(rate: float) -> str:
    # No dot in the name: the report writer would take "rate_0.5" for a file "rate_0" with suffix ".5".
    return f"rate_{rate:g}".replace(".", "_")


def _read_point(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"no bench serve report at {path}")
    return json.loads(path.read_text())["result"]


def _measure(
    args: argparse.Namespace, work: Path, max_model_len: int
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[float, dict[str, Any]]]:
    """Start the cluster, run the idle probe, the CPU calibration load and every rate, stop the cluster."""
    log = work / "serve.log"
    measured: dict[float, dict[str, Any]] = {}
    server = start_cluster(
        args.model,
        args.port,
        args.prefill_workers,
        args.decode_workers,
        log,
        args.warmup,
        args.online_order,
        args.late_last,
    )
    try:
        # Idle probe: requests far apart, so each meets an empty cluster.
        probe = bench_point(args, PROBE_RATE, PROBE_PROMPTS, work / "probe", max_model_len)
        if probe["failed"]:
            raise RuntimeError(f"the idle probe failed on the cluster: {probe['errors']}; see {work}")
        # Background CPU of the idle cluster, then the CPU of a calibration load (other requests: seed + 1).
        pid = server.proc.pid
        t0, a = time.monotonic(), process_cpu(pid)
        time.sleep(IDLE_S)
        t1, b = time.monotonic(), process_cpu(pid)
        calibration = bench_point(
            args, args.calibration_rate, args.num_prompts, work / "calibration", max_model_len, args.seed + 1
        )
        t2, c = time.monotonic(), process_cpu(pid)
        cpu = {
            "idle_s": round(t1 - t0, 3),
            "idle_cpu_s": cluster_cpu(a, b),
            "load_s": round(t2 - t1, 3),
            "load_cpu_s": cluster_cpu(b, c),
            "cores": len(os.sched_getaffinity(0)),
        }
        (work / "cpu.json").write_text(json.dumps(cpu, indent=1))
        for rate in args.rates:
            measured[rate] = bench_point(
                args, rate, args.num_prompts, work / _point_name(rate), max_model_len
            )
            if not args.json:
                print(f"measured {rate} req/s: attainment {measured[rate]['slo_attainment']}", flush=True)
    finally:
        server.stop(grace_s=30.0)
    return probe, calibration, cpu, measured


def idle_overhead_s(work: Path, config: SimConfig, args: argparse.Namespace, **kw: Any) -> float:
    """Median over the probe's requests, the first left out, of measured less simulated TTFT (seconds)."""
    path = work / "probe.requests.jsonl"
    measured = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    sim = simulate(config, args.workload, PROBE_RATE, PROBE_PROMPTS, args.seed, **kw)
    diffs = []
    # Same workload, seed and count: the client sent the simulated requests in the same order.
    for i, (m, r) in enumerate(zip(measured, sim.requests, strict=True)):
        if m["input_len"] != r.prompt_len:
            raise ValueError(
                f"{path}: request {i} has {m['input_len']} prompt tokens, the simulation {r.prompt_len}"
            )
        if i == 0 or not m.get("success") or m.get("ttft_ms") is None or r.first_token is None:
            continue
        diffs.append(m["ttft_ms"] / 1e3 - (r.first_token - r.arrival))
    return max(0.0, statistics.median(diffs)) if diffs else 0.0


def fit_host(
    base: SimConfig, cpu: dict[str, Any], calibration: dict[str, Any], args: argparse.Namespace, **kw: Any
) -> HostModel:
    """The host model from the measured CPU of the calibration load (see the module docstring)."""
    idle = {k: v / cpu["idle_s"] for k, v in cpu["idle_cpu_s"].items()}  # CPU seconds per second, per role
    load = {k: max(0.0, v - idle[k] * cpu["load_s"]) for k, v in cpu["load_cpu_s"].items()}
    # The background keeps running under load: what is left of the cores is what the simulation shares.
    cores = max(0.5, cpu["cores"] - sum(idle.values()))
    tokens = max(1, calibration["total_output_tokens"])
    host_cpu = load["host"] + (calibration.get("client_cpu_s") or 0.0)
    host = HostModel(cores=cores, host_token_cpu_s=host_cpu / tokens)
    for _ in range(FIXED_POINT_ROUNDS):
        sim = simulate(
            replace(base, host=host),
            args.workload,
            args.calibration_rate,
            args.num_prompts,
            args.seed + 1,
            **kw,
        ).summary()
        host = replace(
            host,
            prefill_cpu_factor=max(1.0, load["prefill"] / max(sim["prefill_engine_s"], 1e-9)),
            decode_cpu_factor=max(1.0, load["decode"] / max(sim["decode_engine_s"], 1e-9)),
        )
    return replace(
        host,
        source=(
            f"measured on the running cluster: {cpu['cores']} cores less {sum(idle.values()):.2f} of idle "
            f"background; calibration load of {args.num_prompts} requests at {args.calibration_rate} req/s "
            f"(seed {args.seed + 1}): host {host_cpu:.2f} CPU s over {tokens} tokens, prefill worker "
            f"{load['prefill']:.2f} CPU s, decode worker {load['decode']:.2f} CPU s"
        ),
    )


def run_validation(args: argparse.Namespace) -> int:
    from bench.report import write_report

    if args.calibration_rate is None:
        rates = sorted(args.rates)
        args = argparse.Namespace(**{**vars(args), "calibration_rate": rates[len(rates) // 2]})
    if args.calibration_rate <= 0:
        print(f"error: --calibration-rate must be > 0, got {args.calibration_rate}", file=sys.stderr)
        return 2
    try:
        cost: CostModel = load_cost(args)
        if args.measured:
            for name in ("probe.json", "calibration.json"):
                _read_point(Path(args.measured) / name)
            if not (Path(args.measured) / "cpu.json").is_file():
                raise FileNotFoundError(f"no CPU measurement at {Path(args.measured) / 'cpu.json'}")
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    base = SimConfig(
        cost,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        # The same online order the cluster was started with.
        policy=PriorityPolicy(online_order=args.online_order, late_last=args.late_last == "on"),
    )
    kw = {"max_output_len": args.max_output_len}
    if args.measured:
        # Re-analyse an earlier run: its bench serve reports are read back, nothing is started.
        work = Path(args.measured)
        probe = _read_point(work / "probe.json")
        calibration = _read_point(work / "calibration.json")
        cpu = json.loads((work / "cpu.json").read_text())
        measured = {rate: _read_point(work / f"{_point_name(rate)}.json") for rate in args.rates}
    else:
        work = Path(tempfile.mkdtemp(prefix="bucketserve-validate-"))
        probe, calibration, cpu, measured = _measure(args, work, cost.max_model_len)
    host = fit_host(base, cpu, calibration, args, **kw)
    contended = replace(base, host=host)
    # The idle probe then sets the fixed latency of the serving path: idle TTFT left over once the simulated
    # one (with the host model) is counted.
    try:
        overhead_s = idle_overhead_s(work, contended, args, **kw)
    except (OSError, ValueError) as e:
        print(f"error: the probe's requests: {e}", file=sys.stderr)
        return 2
    adjusted = replace(contended, cost=cost.with_overheads(overhead_s, 0.0))
    sim_probe = simulate(adjusted, args.workload, PROBE_RATE, PROBE_PROMPTS, args.seed, **kw).summary()
    # The earlier method, for comparison: one slowdown from the idle TPOTs and an overhead from the idle TTFT.
    sim_bare_probe = simulate(base, args.workload, PROBE_RATE, PROBE_PROMPTS, args.seed, **kw).summary()
    slowdown = max(1.0, (probe["tpot_p50_ms"] or 0.0) / (sim_bare_probe["tpot_p50_ms"] or 1.0))
    slowed = replace(base, cost=cost.with_slowdown(slowdown))
    sim_slowed = simulate(slowed, args.workload, PROBE_RATE, PROBE_PROMPTS, args.seed, **kw).summary()
    probe_overhead_s = max(0.0, ((probe["ttft_p50_ms"] or 0.0) - (sim_slowed["ttft_p50_ms"] or 0.0)) / 1e3)
    idle_probe = replace(slowed, cost=slowed.cost.with_overheads(probe_overhead_s, 0.0))
    rows = []
    for rate in args.rates:
        m = measured[rate]
        raw = simulate(base, args.workload, rate, args.num_prompts, args.seed, **kw).summary()
        adj = simulate(adjusted, args.workload, rate, args.num_prompts, args.seed, **kw).summary()
        old = simulate(idle_probe, args.workload, rate, args.num_prompts, args.seed, **kw).summary()
        rows.append(
            {
                "rate": rate,
                "measured_attainment": m["slo_attainment"],
                "simulated_attainment": adj["slo_attainment"],
                "error_points": round(100 * (adj["slo_attainment"] - m["slo_attainment"]), 1),
                "simulated_idle_probe": old["slo_attainment"],
                "error_points_idle_probe": round(100 * (old["slo_attainment"] - m["slo_attainment"]), 1),
                "simulated_engine_only": raw["slo_attainment"],
                "error_points_engine_only": round(100 * (raw["slo_attainment"] - m["slo_attainment"]), 1),
                "measured_ttft_p50_ms": m["ttft_p50_ms"],
                "simulated_ttft_p50_ms": adj["ttft_p50_ms"],
                "measured_tpot_p50_ms": m["tpot_p50_ms"],
                "simulated_tpot_p50_ms": adj["tpot_p50_ms"],
                "measured_failed": m["failed"],
                "load_1min": m.get("load_1min"),
            }
        )
    result = {
        "model": args.model,
        "cost_source": cost.source,
        "workload": args.workload,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "workers": {"prefill": args.prefill_workers, "decode": args.decode_workers},
        "online_order": args.online_order,
        "late_last": args.late_last,
        "measured_in": str(work),
        "calibration_rate": args.calibration_rate,
        "host_model": asdict(host),
        "cpu": cpu,
        "calibration_measured_attainment": calibration["slo_attainment"],
        "calibration_simulated_attainment": simulate(
            adjusted, args.workload, args.calibration_rate, args.num_prompts, args.seed + 1, **kw
        ).summary()["slo_attainment"],
        "overhead_ms": round(overhead_s * 1e3, 1),
        "probe_measured_tpot_p50_ms": probe["tpot_p50_ms"],
        "probe_simulated_tpot_p50_ms": sim_probe["tpot_p50_ms"],
        "probe_measured_ttft_p50_ms": probe["ttft_p50_ms"],
        "probe_simulated_ttft_p50_ms": sim_probe["ttft_p50_ms"],
        "idle_probe_slowdown": round(slowdown, 3),
        "idle_probe_overhead_ms": round(probe_overhead_s * 1e3, 1),
        "rows": rows,
        "max_abs_error_points": max(abs(r["error_points"]) for r in rows),
        "max_abs_error_points_idle_probe": max(abs(r["error_points_idle_probe"]) for r in rows),
        "max_abs_error_points_engine_only": max(abs(r["error_points_engine_only"]) for r in rows),
    }
    table = [
        (
            "rate",
            "measured",
            "simulated",
            "error (points)",
            "idle probe",
            "engine only",
            "TTFT p50 m/s",
            "TPOT p50 m/s",
        )
    ]
    for r in rows:
        table.append(
            (
                str(r["rate"]),
                str(r["measured_attainment"]),
                str(r["simulated_attainment"]),
                str(r["error_points"]),
                str(r["simulated_idle_probe"]),
                str(r["simulated_engine_only"]),
                f"{r['measured_ttft_p50_ms']} / {r['simulated_ttft_p50_ms']}",
                f"{r['measured_tpot_p50_ms']} / {r['simulated_tpot_p50_ms']}",
            )
        )
    out = args.out or str(REPORTS_DIR / f"validation_{args.model}")
    write_report(out, f"Simulator validation: {args.model}, {args.workload}", result, table)
    if not args.json:
        for row in table:
            print(" | ".join(row))
    print(json.dumps(result))
    return 0
