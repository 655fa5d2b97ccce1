"""``bucketserve bench sweep``: SLO attainment vs request rate, system by system, on this machine.

Each system is started in turn as its own process group (``bucketserve serve ...`` on a free 127.0.0.1 port, or
``vllm serve`` from its own virtual environment), waited on until ``/health`` answers, measured unloaded once
(one median-length prompt of the workload, alone), then loaded with the online client (:mod:`bench.serve`) at
each rate, and stopped (the whole process group; nothing outlives it). Systems:

* ``ours`` (a): disaggregated prefill/decode, adaptive request buckets and priority policies;
* ``fcfs`` (b): the same cluster with one FCFS queue and no request buckets (a DistServe-like baseline);
* ``colocated`` (c): our colocated workers (continuous batching, no KV transfer);
* ``static`` (d): Hugging Face ``generate`` in static batches behind the same API;
* ``vllm`` (e): ``vllm serve`` on the same checkpoint, when a vLLM environment exists.

SLOs, unless given, are 5x the unloaded TTFT and 5x the unloaded TPOT of system (a) (of the first system that
started when (a) did not). Per system the report gives the highest rate with at least 80% attainment, linearly
interpolated between the measured rates around the crossing, and the ratios of (a) to the others.

Outputs in ``--out``: ``report.json``, ``report.md``, ``slo_attainment.png``, and ``logs/<system>.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.server_process import ServerProcess, free_port, wait_healthy

logger = logging.getLogger(__name__)

# name -> (letter in the terms, description)
SYSTEMS: dict[str, tuple[str, str]] = {
    "ours": ("a", "disaggregated, adaptive request buckets + priority policies"),
    "fcfs": ("b", "disaggregated, one FCFS queue, no request buckets (DistServe-like)"),
    "colocated": ("c", "colocated workers, continuous batching, no KV transfer"),
    "static": ("d", "Hugging Face generate in static batches"),
    "vllm": ("e", "vLLM serve (CPU build) on the same checkpoint"),
}
DEFAULT_SYSTEMS = ",".join(SYSTEMS)
REFERENCE = "ours"
# Ratios reported: (numerator, denominator) of the rate at the target attainment.
RATIO_PAIRS = (("ours", "fcfs"), ("ours", "vllm"), ("ours", "colocated"), ("ours", "static"))
SLO_FACTOR = 5.0
DEFAULT_VLLM_PYTHON = "/tmp/vllm-cpu-venv/bin/python"


# --------------------------------------------------------------------------- analysis (pure)


@dataclass(frozen=True)
class RateAtTarget:
    """The highest rate meeting the target attainment.

    ``kind``: ``interpolated`` (between the last rate meeting it and the next measured one), ``at_least`` (every
    measured rate up to the highest met it: ``rate`` is a lower bound), ``below`` (no measured rate met it: the
    rate is below ``rate``, the lowest measured), ``none`` (nothing measured).
    """

    rate: float | None
    kind: str

    def text(self) -> str:
        if self.rate is None:
            return "-"
        prefix = {"at_least": ">= ", "below": "< "}.get(self.kind, "")
        return f"{prefix}{self.rate:.3g}"


def rate_at_target(points: Sequence[tuple[float, float | None]], target: float = 0.8) -> RateAtTarget:
    """``points``: (rate, attainment); attainment None = not measured (skipped), ignored.

    The highest measured rate with attainment >= target is found; when a higher rate was measured, the rate is
    interpolated linearly between that one and the next measured rate, whose attainment is below target.
    """
    measured = sorted((r, a) for r, a in points if a is not None)
    if not measured:
        return RateAtTarget(None, "none")
    ok = [i for i, (_, a) in enumerate(measured) if a >= target]
    if not ok:
        return RateAtTarget(measured[0][0], "below")
    i = ok[-1]
    r0, a0 = measured[i]
    if i == len(measured) - 1:
        return RateAtTarget(r0, "at_least")
    r1, a1 = measured[i + 1]
    # a1 < target <= a0 here, so the denominator is positive.
    return RateAtTarget(r0 + (a0 - target) / (a0 - a1) * (r1 - r0), "interpolated")


@dataclass(frozen=True)
class Ratio:
    value: float | None
    relation: str  # "=", ">=", "<=", ">", or "?" when the bounds do not decide it

    def text(self) -> str:
        if self.value is None:
            return "-"
        return f"{self.value:.2f}x" if self.relation == "=" else f"{self.relation} {self.value:.2f}x"


def ratio(a: RateAtTarget, b: RateAtTarget) -> Ratio:
    """a / b, with what the bounds allow: a lower bound over an exact rate is a lower bound, and so on."""
    if a.rate is None or b.rate is None or a.kind == "none" or b.kind == "none":
        return Ratio(None, "?")
    if b.kind == "below":
        # b serves less than its lowest measured rate: the ratio is above a / that rate, if a met it at all.
        if a.kind == "below":
            return Ratio(None, "?")
        return Ratio(a.rate / b.rate, ">")
    if a.kind == "below":
        return Ratio(a.rate / b.rate, "<")
    if b.rate <= 0:
        return Ratio(None, "?")
    value = a.rate / b.rate
    exact_a, exact_b = a.kind == "interpolated", b.kind == "interpolated"
    if exact_a and exact_b:
        return Ratio(value, "=")
    if not exact_a and exact_b:
        return Ratio(value, ">=")
    if exact_a and not exact_b:
        return Ratio(value, "<=")
    return Ratio(value, "?")


def derive_slos(
    unloaded: dict[str, dict[str, float | None]],
    reference: str = REFERENCE,
    factor: float = SLO_FACTOR,
    ttft_ms: float | None = None,
    tpot_ms: float | None = None,
) -> dict[str, Any]:
    """The SLOs of the sweep and where they came from.

    Given values win; a missing one is ``factor`` times the unloaded figure of ``reference``, or of the first
    system (in the given order) that has one when the reference has none.
    """
    out: dict[str, Any] = {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "factor": factor}
    sources = {
        "ttft_ms": "given" if ttft_ms is not None else None,
        "tpot_ms": "given" if tpot_ms is not None else None,
    }
    order = [reference] + [s for s in unloaded if s != reference]
    for key, metric in (("ttft_ms", "ttft_ms"), ("tpot_ms", "tpot_ms")):
        if out[key] is not None:
            continue
        for system in order:
            value = (unloaded.get(system) or {}).get(metric)
            if value is not None and value > 0:
                out[key] = round(factor * value, 3)
                sources[key] = (
                    f"{factor:g} x unloaded {metric.split('_')[0].upper()} of {system} ({value:.2f} ms)"
                )
                break
    out["source"] = sources
    return out


# --------------------------------------------------------------------------- report


@dataclass
class SystemRun:
    name: str
    command: list[str] = field(default_factory=list)
    error: str | None = None
    startup_s: float | None = None
    unloaded: dict[str, float | None] = field(default_factory=dict)
    points: list[dict[str, Any]] = field(default_factory=list)  # one bench summary per rate (+ "skipped")

    def curve(self) -> list[tuple[float, float | None]]:
        return [
            (float(p["request_rate"]), None if p.get("skipped") else p.get("slo_attainment"))
            for p in self.points
        ]


def analyse(runs: Sequence[SystemRun], target: float = 0.8) -> dict[str, Any]:
    at = {r.name: rate_at_target(r.curve(), target) for r in runs}
    ratios = {}
    for a, b in RATIO_PAIRS:
        if a in at and b in at:
            ratios[f"{a}/{b}"] = ratio(at[a], at[b])
    return {"rate_at_target": at, "ratios": ratios}


def _f(x: Any, digits: int = 2) -> str:
    return "-" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))


def markdown(doc: dict[str, Any]) -> str:
    cfg, slo = doc["config"], doc["slo"]
    target = cfg["target"]
    rates = cfg["rates"]
    lines = [
        f"# SLO attainment vs request rate ({cfg['workload']}, model {cfg['model']})",
        "",
        f"Command: `{doc['command']}`",
        "",
        f"SLOs: TTFT <= {_f(slo['ttft_ms'])} ms ({slo['source']['ttft_ms']}), "
        f"TPOT <= {_f(slo['tpot_ms'])} ms ({slo['source']['tpot_ms']}). "
        "A request meets its SLO when it succeeded and both bounds hold.",
        "",
        f"{cfg['num_prompts']} prompts per rate, seed {cfg['seed']}, max model length {cfg['max_model_len']}, "
        f"outputs up to {cfg['max_output_len']} tokens.",
        "",
        f"## Highest rate with >= {target:.0%} attainment (req/s)",
        "",
        "| system | | rate | unloaded TTFT ms | unloaded TPOT ms | startup s | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in doc["systems"]:
        letter, _ = SYSTEMS.get(s["name"], ("?", ""))
        at = doc["rate_at_target"].get(s["name"], {})
        rate_text = RateAtTarget(at.get("rate"), at.get("kind", "none")).text()
        note = (s.get("error") or "").replace("|", "\\|").replace("\n", " ")[:200]
        lines.append(
            f"| {s['name']} | ({letter}) | {rate_text} | {_f(s['unloaded'].get('ttft_ms'))} "
            f"| {_f(s['unloaded'].get('tpot_ms'))} | {_f(s.get('startup_s'), 1)} | {note} |"
        )
    lines += ["", "## Ratios of the rate at the target", "", "| ratio | value |", "|---|---|"]
    for name, r in doc["ratios"].items():
        lines.append(f"| {name} | {Ratio(r['value'], r['relation']).text()} |")
    lines += [
        "",
        "`>=`: the numerator met the target at every rate measured (a lower bound); `<=` the denominator did; "
        "`>`/`<`: one system met it at no measured rate; `?`: the bounds decide nothing.",
        "",
        "## SLO attainment per rate",
        "",
        "| system | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
        "|---|" + "---|" * len(rates),
    ]
    for s in doc["systems"]:
        by_rate = {float(p["request_rate"]): p for p in s["points"]}
        cells = []
        for r in rates:
            p = by_rate.get(float(r))
            if p is None:
                cells.append("-")
            elif p.get("skipped"):
                cells.append("skipped")
            else:
                cells.append(f"{_f(p.get('slo_attainment'))} ({p.get('failed', 0)} failed)")
        lines.append(f"| {s['name']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Latency per rate (p50 / p99 ms)",
        "",
        "| system | rate | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | goodput req/s | output tok/s | load 1m |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in doc["systems"]:
        for p in s["points"]:
            if p.get("skipped"):
                continue
            lines.append(
                f"| {s['name']} | {p['request_rate']} | {_f(p.get('ttft_p50_ms'), 1)} | {_f(p.get('ttft_p99_ms'), 1)} "
                f"| {_f(p.get('tpot_p50_ms'), 1)} | {_f(p.get('tpot_p99_ms'), 1)} | {_f(p.get('goodput_rps'))} "
                f"| {_f(p.get('output_tok_per_s'), 1)} | {_f(p.get('load_avg_1m'), 1)} |"
            )
    lines += ["", "## Systems", ""]
    for s in doc["systems"]:
        letter, desc = SYSTEMS.get(s["name"], ("?", ""))
        lines.append(f"- **{s['name']}** ({letter}): {desc}. `{shlex.join(s['command'])}`")
    if doc.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in doc["notes"]]
    env = doc["environment"]
    lines += [
        "",
        f"Environment: Python {env['python']}, torch {env['torch']}, {env['cpus']} threads, {env['time']}.",
    ]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in doc["systems"]:
        pts = [(float(p["request_rate"]), p["slo_attainment"]) for p in s["points"] if not p.get("skipped")]
        pts = [(r, a) for r, a in pts if a is not None]
        if not pts:
            continue
        letter, _ = SYSTEMS.get(s["name"], ("?", ""))
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, [100 * y for y in ys], marker="o", label=f"({letter}) {s['name']}")
    target = doc["config"]["target"]
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label=f"{target:.0%} target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-3, 103)
    cfg, slo = doc["config"], doc["slo"]
    ax.set_title(
        f"{cfg['workload']}, {cfg['model']}: TTFT <= {_f(slo['ttft_ms'], 0)} ms, TPOT <= {_f(slo['tpot_ms'], 1)} ms",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_doc(
    config: dict[str, Any], slo: dict[str, Any], runs: Sequence[SystemRun], notes: Sequence[str] = ()
) -> dict[str, Any]:
    from bench.report import command_line, environment

    result = analyse(runs, config["target"])
    return {
        "command": command_line(),
        "environment": environment(),
        "config": config,
        "slo": slo,
        "systems": [asdict(r) for r in runs],
        "rate_at_target": {k: asdict(v) for k, v in result["rate_at_target"].items()},
        "ratios": {k: asdict(v) for k, v in result["ratios"].items()},
        "notes": list(notes),
    }


def write_sweep_report(out_dir: str | Path, doc: dict[str, Any]) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md", "png": out / "slo_attainment.png"}
    paths["json"].write_text(json.dumps(doc, indent=2) + "\n")
    paths["md"].write_text(markdown(doc))
    plot(doc, paths["png"])
    return paths


# --------------------------------------------------------------------------- running systems


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
    elif system == "static":
        cmd += ["--mode", "static", "--static-batch-size", str(args.static_batch_size)]
    else:
        raise ValueError(f"unknown system {system!r}; known: {sorted(SYSTEMS)}")
    if system != "static":
        cmd += shlex.split(args.serve_args)
    return cmd, {}


def median_request(requests: list[Any]) -> Any:
    """The request whose prompt length is the median of the workload's (the lower one for an even count)."""
    ordered = sorted(requests, key=lambda r: r.input_len)
    return ordered[(len(ordered) - 1) // 2]


async def measure_unloaded(
    base_url: str, probe: Any, model: str, repeats: int = 3, min_output: int = 16
) -> dict[str, float | None]:
    """TTFT and TPOT of one request alone (the median prompt), the median of ``repeats`` runs after one
    discarded warm run."""
    from dataclasses import replace

    from bench.serve import run_benchmark

    req = replace(probe, send_at=0.0, output_len=max(probe.output_len, min_output))
    ttfts, tpots = [], []
    for i in range(repeats + 1):
        one = replace(req, request_id=f"unloaded-{i}")
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
        "input_len": probe.input_len,
        "output_len": req.output_len,
    }


def run_system(
    system: str,
    args: argparse.Namespace,
    out_dir: Path,
    make: Any,
    slo_for: Any,
) -> SystemRun:
    """Start, measure and stop one system. ``make(rate)`` builds the requests; ``slo_for(run)`` gives the
    (TTFT, TPOT) bounds once the system's unloaded figures are known."""
    from bench.serve import run_benchmark

    port = free_port()
    cmd, env = system_command(system, args, port)
    run = SystemRun(system, cmd)
    base = f"http://127.0.0.1:{port}"
    logger.info("%s: starting: %s", system, shlex.join(cmd))
    server = ServerProcess(cmd, env, out_dir / "logs" / f"{system}.log")
    try:
        run.startup_s = round(wait_healthy(base, server, args.startup_timeout_s), 1)
        logger.info("%s: healthy after %.0fs", system, run.startup_s)
        probe = median_request(make(args.rates[0]))
        run.unloaded = asyncio.run(measure_unloaded(base, probe, args.model))
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
            result = asyncio.run(
                run_benchmark(
                    base,
                    make(rate),
                    model=args.model,
                    slo_ttft_ms=ttft_slo,
                    slo_tpot_ms=tpot_slo,
                    timeout_s=args.request_timeout_s,
                    progress=not args.no_progress,
                    request_rate=rate,
                )
            )
            summary = result.summary()
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


# --------------------------------------------------------------------------- command line


def _rates(text: str) -> list[float]:
    try:
        rates = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates takes numbers separated by commas, got {text!r}") from None
    if not rates or any(not r > 0 or r == float("inf") for r in rates):
        raise argparse.ArgumentTypeError(f"--rates must be finite numbers > 0, got {text!r}")
    return rates


def _systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    # The reference runs first: the others' SLOs come from its unloaded figures.
    return sorted(dict.fromkeys(names), key=lambda s: s != REFERENCE)


def register(sub) -> None:
    from bench.workloads import WORKLOADS

    p = sub.add_parser("sweep", help="SLO attainment vs request rate for each system, with a plot")
    p.add_argument("--workload", choices=WORKLOADS, default="mixed")
    p.add_argument("--rates", type=_rates, required=True, help="request rates, e.g. 0.5,1,2,4")
    p.add_argument(
        "--systems", type=_systems, default=_systems(DEFAULT_SYSTEMS), help=f"of {DEFAULT_SYSTEMS}"
    )
    p.add_argument("--num-prompts", type=int, default=40, help="requests per rate")
    p.add_argument("--model", default="small")
    p.add_argument(
        "--slo-ttft-ms", type=float, default=None, help=f"default: {SLO_FACTOR:g}x unloaded TTFT of (a)"
    )
    p.add_argument(
        "--slo-tpot-ms", type=float, default=None, help=f"default: {SLO_FACTOR:g}x unloaded TPOT of (a)"
    )
    p.add_argument("--target", type=float, default=0.8, help="attainment whose rate is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048, help="every system serves this length")
    p.add_argument("--max-output-len", type=int, default=128, help="longest output of the workload")
    p.add_argument("--colocated-workers", type=int, default=2, help="(c): as many workers as (a) has")
    p.add_argument("--static-batch-size", type=int, default=8)
    p.add_argument("--serve-args", default="", help="extra flags for our bucketserve serve systems")
    p.add_argument("--vllm-python", default=os.environ.get("BUCKETSERVE_VLLM_PYTHON", DEFAULT_VLLM_PYTHON))
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--stop-below",
        type=float,
        default=0.05,
        help="skip a system's higher rates once attainment is below this",
    )
    p.add_argument(
        "--keep-from",
        default=None,
        help="report.json of an earlier sweep: its SLOs (unless given) and the systems not run now are kept",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="bench/results/sweep", help="folder of the report")
    p.set_defaults(func=run)


def load_kept(path: str | Path, rerun: Sequence[str]) -> tuple[dict[str, Any], list[SystemRun]]:
    """The SLOs and the runs of the systems not in ``rerun`` from an earlier sweep's report.json."""
    doc = json.loads(Path(path).read_text())
    keep = [SystemRun(**s) for s in doc.get("systems", []) if s["name"] not in rerun]
    return doc.get("slo") or {}, keep


def run(args: argparse.Namespace) -> int:
    from bench.serve import make_requests
    from bench.workloads import load_alpaca_texts
    from engine.model_loader import ModelNotFoundError, load_tokenizer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress
    if not 0 < args.target <= 1:
        print(f"error: --target must be in (0, 1], got {args.target}", file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(args.model)
        texts = load_alpaca_texts(_dataset()) if args.workload in ("alpaca", "mixed") else None
    except (FileNotFoundError, ValueError, ModelNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    cache: dict[float, list[Any]] = {}

    def make(rate: float) -> list[Any]:
        # Same prompts and lengths at every rate (one seed); only the arrival times scale with the rate.
        if rate not in cache:
            cache[rate] = make_requests(
                args.workload,
                args.num_prompts,
                rate,
                tokenizer,
                seed=args.seed,
                max_model_len=args.max_model_len,
                max_output_len=args.max_output_len,
                alpaca_texts=texts,
            )
        return cache[rate]

    unloaded: dict[str, dict[str, float | None]] = {}
    slo: dict[str, Any] = {}
    runs: list[SystemRun] = []
    if args.keep_from:
        try:
            kept_slo, runs = load_kept(args.keep_from, args.systems)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: --keep-from {args.keep_from}: {e}", file=sys.stderr)
            return 2
        # The kept systems were measured against these SLOs: the new ones must be too, unless told otherwise.
        if args.slo_ttft_ms is None and args.slo_tpot_ms is None and kept_slo.get("ttft_ms"):
            slo.update(kept_slo)
        for r in runs:
            unloaded[r.name] = r.unloaded

    def slo_for(run_: SystemRun) -> tuple[float, float]:
        unloaded[run_.name] = run_.unloaded
        if not slo:  # fixed by the first system measured: (a) when it started
            slo.update(derive_slos(unloaded, REFERENCE, SLO_FACTOR, args.slo_ttft_ms, args.slo_tpot_ms))
        if slo["ttft_ms"] is None or slo["tpot_ms"] is None:
            raise RuntimeError("no SLO: give --slo-ttft-ms/--slo-tpot-ms or a system with unloaded figures")
        return slo["ttft_ms"], slo["tpot_ms"]

    notes = [
        f"Run on {os.cpu_count()} CPU cores shared with other work on the machine; figures move with its load.",
        "Static batching returns each request's tokens at once when its batch ends: its TTFT is the whole "
        "batch's time and its TPOT is near zero.",
        f"Our colocated system runs {args.colocated_workers} workers, as (a) and (b) run one prefill and one "
        "decode worker.",
    ]
    config = {
        "workload": args.workload,
        "rates": args.rates,
        "systems": args.systems,
        "num_prompts": args.num_prompts,
        "model": args.model,
        "seed": args.seed,
        "target": args.target,
        "max_model_len": args.max_model_len,
        "max_output_len": args.max_output_len,
        "stop_below": args.stop_below,
        "kept_from": args.keep_from,
    }
    if runs:
        config["systems"] = [r.name for r in runs] + list(args.systems)
        config["rates"] = sorted({*args.rates, *(float(p["request_rate"]) for r in runs for p in r.points)})
        notes.append(f"Systems {', '.join(r.name for r in runs)} were measured earlier ({args.keep_from}).")
    for system in args.systems:
        if system == "vllm" and not Path(args.vllm_python).exists():
            runs.append(SystemRun(system, error=f"no vLLM environment at {args.vllm_python}"))
            continue
        runs.append(run_system(system, args, out_dir, make, slo_for))
        # Written after every system, so a long sweep that is cut short keeps what it measured.
        doc = build_doc(
            config,
            slo or derive_slos({}, REFERENCE, SLO_FACTOR, args.slo_ttft_ms, args.slo_tpot_ms),
            runs,
            notes,
        )
        paths = write_sweep_report(out_dir, doc)
    summary = {
        "rate_at_target": doc["rate_at_target"],
        "ratios": doc["ratios"],
        "slo": {k: slo.get(k) for k in ("ttft_ms", "tpot_ms")},
        "errors": {r.name: r.error for r in runs if r.error},
    }
    print(f"report: {paths['json']}, {paths['md']}, {paths['png']}")
    print(json.dumps(summary))
    return 0


def _dataset() -> str:
    from bench.serve import DEFAULT_DATASET

    return str(DEFAULT_DATASET)
