"""``bucketserve bench sweep``: SLO attainment vs request rate, system by system, on this machine.

Each system is started in turn as its own process group (``bucketserve serve ...`` on a free 127.0.0.1 port, the
static batching baseline :mod:`bench.baselines.static_batching`, or ``vllm serve`` from its own virtual
environment), waited on until ``/health`` answers, measured unloaded once (one median-length prompt of the
workload, alone), then loaded with the online client (:mod:`bench.client`) at each rate, and stopped (the whole
process group; nothing outlives it). Systems:

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
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from bench.sweep_report import SYSTEMS, SystemRun, build_doc, kept_from, write_sweep_report
from bench.sweep_systems import DEFAULT_VLLM_PYTHON, run_system
from bench.workloads import DEFAULT_DATASET

DEFAULT_SYSTEMS = ",".join(SYSTEMS)
REFERENCE = "ours"
SLO_FACTOR = 5.0


# --------------------------------------------------------------------------- SLOs (pure)


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


def _finite_number(text: str, flag: str, low: float, inclusive: bool) -> float:
    """``text`` as a finite number above ``low`` (or at it, when ``inclusive``); errors name ``flag``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} takes a number, got {text!r}") from None
    if not ((value >= low) if inclusive else (value > low)) or value == float("inf"):
        bound = f"{'>=' if inclusive else '>'} {low:g}"
        raise argparse.ArgumentTypeError(f"{flag} must be a finite number {bound}, got {text!r}")
    return value


def _burstiness(text: str) -> float:
    return _finite_number(text, "--burstiness", 0, inclusive=False)


def _offline_slo_scale(text: str) -> float:
    return _finite_number(text, "--offline-slo-scale", 1, inclusive=True)


def register(sub) -> None:
    from bench.workloads import WORKLOADS

    p = sub.add_parser("sweep", help="SLO attainment vs request rate for each system, with a plot")
    p.add_argument("--workload", choices=WORKLOADS, default="mixed")
    p.add_argument("--rates", type=_rates, required=True, help="request rates, e.g. 0.5,1,2,4")
    p.add_argument(
        "--systems", type=_systems, default=_systems(DEFAULT_SYSTEMS), help=f"of {DEFAULT_SYSTEMS}"
    )
    p.add_argument("--num-prompts", type=int, default=40, help="requests per rate")
    p.add_argument(
        "--burstiness",
        type=_burstiness,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 Poisson, below 1 bursts (0.25: most requests in a few bursts)",
    )
    p.add_argument(
        "--priority-mix",
        default=None,
        metavar="ONLINE:OFFLINE",
        help="class weights of the requests, e.g. 1:1 (default: every request online)",
    )
    p.add_argument(
        "--offline-slo-scale",
        type=_offline_slo_scale,
        default=1.0,
        metavar="F",
        help="with --priority-mix: offline requests meet their SLO within F times the TTFT and TPOT bounds "
        "(default 1: one SLO for every request)",
    )
    p.add_argument(
        "--same-prompts",
        action="store_true",
        help="every rate sends the same requests (arrival gaps scaled to the rate) instead of a draw of its own: "
        "the curve then moves with the rate alone; not with vllm, whose prefix cache would serve every rate after "
        "the first",
    )
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
    p.add_argument(
        "--client",
        choices=("ours", "vllm"),
        default="ours",
        help="load client: ours (bench.client) or vllm (`vllm bench serve` from --vllm-python's environment, "
        "on its own random dataset: needs --workload random)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="bench/results/sweep", help="folder of the report")
    p.set_defaults(func=run)


def colocated_note(workers: int) -> str:
    """What the report says of the colocated system's size beside (a) and (b)'s one prefill and one decode
    worker."""
    if workers == 2:
        return "Our colocated system runs 2 workers, as (a) and (b) run one prefill and one decode worker."
    each = "one worker with all the cores" if workers == 1 else f"{workers} workers"
    return f"Our colocated system runs {each}; (a) and (b) run one prefill and one decode worker."


def run(args: argparse.Namespace) -> int:
    from bench.workload_requests import draw_seed, make_requests, parse_priority_mix
    from bench.workloads import load_alpaca_texts
    from engine.model_loader import ModelNotFoundError, load_tokenizer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress
    if not 0 < args.target <= 1:
        print(f"error: --target must be in (0, 1], got {args.target}", file=sys.stderr)
        return 2
    if args.client == "vllm":
        problem = None
        if not Path(args.vllm_python).exists():
            problem = f"--client vllm needs vLLM's environment; none at {args.vllm_python} (--vllm-python)"
        elif args.workload != "random":
            problem = f"--client vllm runs vLLM's random dataset: give --workload random, not {args.workload}"
        elif args.priority_mix:
            problem = "--client vllm sends one class of requests: --priority-mix does not apply"
        elif args.offline_slo_scale != 1.0:
            problem = "--client vllm sends one class of requests: --offline-slo-scale does not apply"
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if args.same_prompts and (
        args.client == "vllm" or "vllm" in args.systems or "prefix-caching" in args.serve_args
    ):
        print(
            "error: --same-prompts sends one set of prompts at every rate, which a prefix cache (vLLM's, or ours "
            "with --prefix-caching) would serve from the second rate on: leave it out, or drop --same-prompts",
            file=sys.stderr,
        )
        return 2
    try:
        online_share = parse_priority_mix(args.priority_mix)
        tokenizer = load_tokenizer(args.model)
        texts = load_alpaca_texts(DEFAULT_DATASET) if args.workload in ("alpaca", "mixed") else None
    except (FileNotFoundError, ValueError, ModelNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    cache: dict[tuple[float, str], list[Any]] = {}

    def make(rate: float, draw: str = "load") -> list[Any]:
        # Each rate (and the unloaded probe) draws prompts of its own from the workload: see draw_seed.
        if (rate, draw) not in cache:
            cache[rate, draw] = make_requests(
                args.workload,
                args.num_prompts,
                rate,
                tokenizer,
                seed=draw_seed(args.seed, rate, draw, same_every_rate=args.same_prompts),
                burstiness=args.burstiness,
                max_model_len=args.max_model_len,
                max_output_len=args.max_output_len,
                online_share=online_share,
                alpaca_texts=texts,
            )
        return cache[rate, draw]

    unloaded: dict[str, dict[str, float | None]] = {}
    slo: dict[str, Any] = {}
    runs: list[SystemRun] = []
    if args.keep_from:
        try:
            kept_doc = json.loads(Path(args.keep_from).read_text())
            kept_slo, runs = kept_from(kept_doc, args.systems)
            kept_same = bool(kept_doc["config"].get("same_prompts", False))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: --keep-from {args.keep_from}: {e}", file=sys.stderr)
            return 2
        if kept_same != args.same_prompts:
            print(
                f"error: --keep-from {args.keep_from} was measured {'with' if kept_same else 'without'} "
                "--same-prompts: its systems saw other requests than this sweep's would",
                file=sys.stderr,
            )
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
        (
            "Every rate sends the same requests (--same-prompts: seeded from --seed alone, the arrival gaps "
            "scaled to the rate); no system here caches prefixes (the option refuses vLLM and --prefix-caching)."
            if args.same_prompts
            else "Each rate sends prompts of its own (seeded from --seed and the rate), from the same distribution: "
            "a server that caches prefixes (vLLM does by default) gains nothing from an earlier rate's prompts."
        ),
        colocated_note(args.colocated_workers),
    ]
    if args.client == "vllm":
        notes.append(
            "Load from `vllm bench serve` (vLLM's random dataset: 256 +- 90% prompt tokens, 64 out, EOS ignored; "
            "its goodput accounting, failed requests counted as misses); the unloaded probe is our client's."
        )
    config = {
        "workload": args.workload,
        "rates": args.rates,
        "systems": args.systems,
        "num_prompts": args.num_prompts,
        "burstiness": args.burstiness,
        "priority_mix": args.priority_mix,
        "offline_slo_scale": args.offline_slo_scale,
        "model": args.model,
        "seed": args.seed,
        "same_prompts": args.same_prompts,
        "target": args.target,
        "max_model_len": args.max_model_len,
        "max_output_len": args.max_output_len,
        "stop_below": args.stop_below,
        "kept_from": args.keep_from,
        "client": "vllm bench serve" if args.client == "vllm" else "bench.client",
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
