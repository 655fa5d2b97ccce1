"""``bucketserve simulate``: the capacity simulator.

* default: project the SLO-attainment curve of ``--prefill-workers`` + ``--decode-workers`` (or colocated
  workers) over ``--rates``, with costs from ``--calibration FILE`` (measured) or ``--hardware
  gaudi2|gaudi3|h100|h200`` (projection); with ``--target-rate`` also recommend a prefill:decode split of
  ``--cards`` cards;
* ``--plan`` (with ``--hardware`` and ``--target-rate``): the fewest workers, their split and the nodes they
  take to hold ``--goal`` SLO attainment at that rate;
* ``--calibrate``: measure the engine on this machine and write a calibration JSON;
* ``--validate``: start the cluster, measure attainment at each rate and compare with the simulation.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates must be numbers separated by commas, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return rates


def register(sub: argparse._SubParsersAction) -> None:
    from bench.simulator.cost_model import ACCELERATORS, PROJECTION_MODELS
    from bench.workloads import WORKLOADS

    p = sub.add_parser("simulate", help="capacity simulator: SLO attainment vs rate, prefill:decode split")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--calibrate", action="store_true", help="measure the engine and write --out")
    what.add_argument(
        "--validate", action="store_true", help="simulated vs measured attainment on this machine"
    )
    p.add_argument("--model", default="small", help="--calibrate/--validate/--save-split: the engine's model")
    p.add_argument(
        "--out", default=None, help="--calibrate: JSON path; otherwise a report path (no extension)"
    )
    p.add_argument("--repeats", type=int, default=3, help="--calibrate: timed runs per shape")
    p.add_argument("--num-threads", type=int, default=1, help="--calibrate: torch threads (a worker's)")
    p.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda", "hpu"), help="--calibrate: the engine's device"
    )
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="--calibrate: weights"
    )
    costs = p.add_mutually_exclusive_group()
    costs.add_argument(
        "--calibration", default=None, help="calibration JSON (default: calibration_<model>.json)"
    )
    costs.add_argument("--hardware", choices=sorted(ACCELERATORS), default=None, help="projection per card")
    p.add_argument("--projection-model", choices=sorted(PROJECTION_MODELS), default="llama3-8b")
    p.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--colocated-workers", type=int, default=1)
    p.add_argument("--no-request-buckets", action="store_true", help="baseline: one FCFS queue, no splits")
    p.add_argument(
        "--online-order", choices=("arrival", "deadline", "sjf"), default="arrival", help="as serve's flag"
    )
    p.add_argument("--late-last", choices=("on", "off"), default="on", help="as serve's flag")
    p.add_argument("--workload", choices=WORKLOADS, default="mixed")
    p.add_argument("--rates", type=_rates, default=[1.0, 2.0, 4.0, 8.0], help="comma-separated req/s")
    p.add_argument("--num-prompts", type=int, default=500, help="requests per simulated (or measured) rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--slo-ttft-ms", type=float, default=450.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--target-rate", type=float, default=None, help="recommend a prefill:decode split for it")
    p.add_argument(
        "--save-split",
        action="store_true",
        help="with --target-rate: keep the recommended split for `serve --prefill-workers auto --decode-workers "
        "auto` of --model (under $BUCKETSERVE_CACHE/splits/)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="with --hardware and --target-rate: the fewest workers and nodes, and their split, that hold --goal",
    )
    p.add_argument("--goal", type=float, default=0.9, help="--plan: SLO attainment to hold (default 0.9)")
    p.add_argument("--max-workers", type=int, default=64, help="--plan: the most workers to try")
    p.add_argument(
        "--cards", type=int, default=None, help="cards to split (default: prefill + decode workers)"
    )
    p.add_argument("--port", type=int, default=8765, help="--validate: the cluster's port")
    p.add_argument("--warmup", action="store_true", help="--validate: warm the cluster's shapes up first")
    p.add_argument(
        "--calibration-rate",
        type=float,
        default=None,
        help="--validate: req/s of the CPU calibration load (other requests: seed + 1; default: the median rate)",
    )
    p.add_argument(
        "--measured",
        default=None,
        help="--validate: re-analyse the bench reports in this folder, run nothing",
    )
    p.add_argument("--json", action="store_true", help="print only the final JSON line")
    p.set_defaults(func=run)


def _print_rows(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'rate':>6} {'attain':>7} {'goodput':>8} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} {'tpot p99':>9}"
    )
    for r in rows:
        print(
            f"{r['request_rate']:>6} {r['slo_attainment']:>7} {r['goodput_rps']:>8} {r['ttft_p50_ms']:>9} "
            f"{r['ttft_p99_ms']:>9} {r['tpot_p50_ms']:>9} {r['tpot_p99_ms']:>9}"
        )


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    if args.validate:
        from bench.simulator.validate import run_validation

        return run_validation(args)
    from bench.simulator.capacity import curve, recommend_split
    from bench.simulator.cost_model import load_cost
    from bench.simulator.sim import SimConfig
    from bucket_manager.priority import PriorityPolicy

    try:
        cost = load_cost(args)
        config = SimConfig(
            cost,
            mode=args.mode,
            prefill_workers=args.prefill_workers,
            decode_workers=args.decode_workers,
            colocated_workers=args.colocated_workers,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            request_buckets=not args.no_request_buckets,
            policy=PriorityPolicy(online_order=args.online_order, late_last=args.late_last == "on"),
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kw = {"burstiness": args.burstiness, "max_output_len": args.max_output_len}
    result: dict[str, Any] = {
        "cost_model": cost.name,
        "cost_source": cost.source,
        "mode": args.mode,
        "workers": (
            {"colocated": args.colocated_workers}
            if args.mode == "colocated"
            else {"prefill": args.prefill_workers, "decode": args.decode_workers}
        ),
        "workload": args.workload,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
    }
    if args.plan:
        return _plan(args, config, result, kw)
    result |= curve(config, args.workload, args.rates, args.num_prompts, args.seed, **kw)
    if args.target_rate is not None:
        cards = args.cards or (
            args.colocated_workers if args.mode == "colocated" else args.prefill_workers + args.decode_workers
        )
        try:
            result["split"] = recommend_split(
                config, cards, args.workload, args.target_rate, args.num_prompts, args.seed, **kw
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.save_split:
            result["split"]["saved_to"] = str(_save_split(args, cost.name, result["split"]))
    elif args.save_split:
        print("error: --save-split needs --target-rate (the rate to choose the split for)", file=sys.stderr)
        return 2
    if not args.json:
        print(f"cost model {cost.name}: {cost.source}")
        _print_rows(result["rows"])
        print(f"highest rate with >= 80% attainment: {result['max_rate_at_80pct']}")
        if "split" in result:
            s = result["split"]
            print(
                f"recommended prefill:decode for {s['target_rate']} req/s on {s['cards']} cards: "
                f"{s['recommended']} ({s['recommended_attainment']} attainment)"
            )
            if "saved_to" in s:
                print(
                    f"kept for `serve --model {args.model} --prefill-workers auto --decode-workers auto`: {s['saved_to']}"
                )
    if args.out:
        from bench.report import write_report

        write_report(args.out, f"Simulated capacity: {args.workload}, {cost.name}", result)
    print(json.dumps(result))
    return 0


def _save_split(args: argparse.Namespace, cost_name: str, split: dict[str, Any]):
    """Keep the recommended split where ``serve --prefill-workers auto`` reads it."""
    import datetime

    from gateway.worker_split import WorkerSplit, save_split

    p, d = (int(x) for x in split["recommended"].split(":"))
    return save_split(
        WorkerSplit(
            model=args.model,
            prefill_workers=p,
            decode_workers=d,
            target_rate=args.target_rate,
            workload=args.workload,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            attainment=split["recommended_attainment"],
            cost_model=cost_name,
            made_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        )
    )


def _plan(args: argparse.Namespace, config, result: dict[str, Any], kw: dict[str, Any]) -> int:
    """``--plan``: size a cluster of ``--hardware`` for ``--target-rate`` (a projection)."""
    from bench.simulator.capacity import plan_cluster
    from bench.simulator.cost_model import ACCELERATORS, tensor_parallel

    if not args.hardware or args.target_rate is None:
        print("error: --plan needs --hardware and --target-rate", file=sys.stderr)
        return 2
    tp = tensor_parallel(args.hardware, args.projection_model)
    try:
        plan = plan_cluster(
            config,
            tp,
            ACCELERATORS[args.hardware].cards_per_node,
            args.workload,
            args.target_rate,
            args.num_prompts,
            goal=args.goal,
            max_workers=args.max_workers,
            seed=args.seed,
            **kw,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["plan"] = plan
    if not args.json:
        print(f"cost model {result['cost_model']}: {result['cost_source']}")
        if plan["reached"]:
            print(
                f"{args.target_rate} req/s at >= {args.goal:.0%} SLO attainment (projection): "
                f"{plan['prefill_workers']} prefill + {plan['decode_workers']} decode workers of {tp} card(s), "
                f"{plan['nodes']} nodes of {ACCELERATORS[args.hardware].cards_per_node} "
                f"({plan['attainment']} attainment)"
            )
        else:
            print(f"not reached within {args.max_workers} workers: best {plan['best']['recommended']}")
    if args.out:
        from bench.report import write_report

        write_report(args.out, f"Cluster plan: {args.workload}, {result['cost_model']}", result)
    print(json.dumps(result))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from bench.simulator.calibrate import calibrate
    from bench.simulator.cost_model import calibration_path
    from engine.model_loader import ModelNotFoundError

    out = Path(args.out) if args.out else calibration_path(args.model)
    try:
        cost, extra = calibrate(
            args.model,
            args.num_threads,
            args.repeats,
            progress=not args.json,
            device=args.device,
            dtype=args.dtype,
        )
    except (ModelNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cost.save(out, extra)
    if not args.json:
        print(f"calibration written to {out}: {cost.source}")
    print(json.dumps({"calibration": str(out), **cost.to_dict(), "fit": extra["fit"]}))
    return 0
