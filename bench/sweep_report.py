"""The report of ``bucketserve bench sweep``: each system's run, the rates at the target attainment and their
ratios, written as ``report.json``, ``report.md`` and the ``slo_attainment.png`` plot."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.metrics import RateAtTarget, Ratio, rate_at_target, ratio

# name -> (letter in the report, description)
SYSTEMS: dict[str, tuple[str, str]] = {
    "ours": ("a", "disaggregated, adaptive request buckets + priority policies"),
    "fcfs": ("b", "disaggregated, one FCFS queue, no request buckets (DistServe-like)"),
    "colocated": ("c", "colocated workers, continuous batching, no KV transfer"),
    "static": ("d", "Hugging Face generate in static batches"),
    "vllm": ("e", "vLLM serve (CPU build) on the same checkpoint"),
}
# Ratios reported: (numerator, denominator) of the rate at the target attainment.
RATIO_PAIRS = (("ours", "fcfs"), ("ours", "vllm"), ("ours", "colocated"), ("ours", "static"))


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
        + (
            # The random workload has its own lengths (as vLLM's random dataset), whatever --max-output-len says.
            "prompts of 256 +- 90% tokens, 64 out"
            if cfg["workload"] == "random"
            else f"outputs up to {cfg['max_output_len']} tokens"
        )
        + f"; load from {cfg.get('client', 'bench.client')}; arrivals: "
        + (
            "Poisson"
            if cfg.get("burstiness", 1.0) == 1.0
            else f"gamma gaps of shape {cfg['burstiness']:g} (bursts)"
        )
        + (f"; classes online:offline {cfg['priority_mix']}." if cfg.get("priority_mix") else "; all online.")
        + (
            f" Offline requests meet their SLO within {cfg['offline_slo_scale']:g}x both bounds."
            if cfg.get("offline_slo_scale", 1.0) != 1.0
            else ""
        ),
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


def kept_from(doc: dict[str, Any], rerun: Sequence[str]) -> tuple[dict[str, Any], list[SystemRun]]:
    """The SLOs and the runs of the systems not in ``rerun`` from an earlier sweep's report (its report.json,
    read)."""
    keep = [SystemRun(**s) for s in doc.get("systems", []) if s["name"] not in rerun]
    return doc.get("slo") or {}, keep
