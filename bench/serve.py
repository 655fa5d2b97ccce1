"""``bucketserve bench serve``: an online benchmark of any OpenAI-compatible server at a request rate.

The requests of a workload (:mod:`bench.workload_requests`) go out through the streaming client
(:mod:`bench.client`); the report gives throughput, SLO attainment, goodput and latency percentiles
(:mod:`bench.metrics`), with one line a request beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from typing import Any

from bench.client import run_benchmark
from bench.workloads import DEFAULT_DATASET, WORKLOADS


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = _rate(text)
    if math.isinf(value):
        raise argparse.ArgumentTypeError("must be finite")
    return value


def register(sub) -> None:
    p = sub.add_parser(
        "serve", help="online benchmark of an OpenAI-compatible server: SLO attainment, goodput"
    )
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--workload", choices=WORKLOADS, default="mixed")
    p.add_argument("--request-rate", type=_rate, required=True, help="requests per second (inf: all at once)")
    p.add_argument(
        "--burstiness", type=_positive_float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier"
    )
    p.add_argument("--num-prompts", type=_positive_int, default=100)
    p.add_argument("--slo-ttft-ms", type=_positive_float, default=450.0)
    p.add_argument("--slo-tpot-ms", type=_positive_float, default=50.0)
    p.add_argument("--model", default="default", help="model whose tokenizer measures prompt lengths")
    p.add_argument("--served-model-name", default=None, help="'model' sent to the server (default: --model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--priority-mix", default=None, metavar="ONLINE:OFFLINE", help="class weights, e.g. 3:1")
    p.add_argument("--priority-format", choices=("name", "int"), default="name", help="int: 0/1 (vLLM)")
    p.add_argument("--random-input-len", type=_positive_int, default=256)
    p.add_argument("--random-output-len", type=_positive_int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.9)
    p.add_argument("--max-model-len", type=_positive_int, default=None, help="default: the model's limit")
    p.add_argument("--max-output-len", type=_positive_int, default=1024)
    p.add_argument("--dataset", default=str(DEFAULT_DATASET), help="Alpaca seed tasks (alpaca, mixed)")
    p.add_argument("--prompt-format", choices=("text", "token-ids"), default="text")
    p.add_argument("--max-connections", type=_positive_int, default=256, help="open connections at most")
    p.add_argument("--timeout-s", type=_positive_float, default=600.0, help="longest wait for one read")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    p.add_argument("--out", default="bench/results/serve", help="report path (without extension)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print only the final JSON line")
    p.set_defaults(func=run)


def _model_max_len(model: str) -> int:
    """The model's ``max_position_embeddings`` (4096 when its config does not say)."""
    from engine.model_loader import resolve_model_path

    config = resolve_model_path(model) / "config.json"
    try:
        return int(json.loads(config.read_text()).get("max_position_embeddings") or 4096)
    except (OSError, ValueError):
        return 4096


def run(args: argparse.Namespace) -> int:
    from bench.report import write_report
    from bench.workload_requests import make_requests, parse_priority_mix
    from bench.workloads import load_alpaca_texts
    from engine.model_loader import ModelNotFoundError, load_tokenizer

    try:
        if not args.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
        online_share = parse_priority_mix(args.priority_mix)
        tokenizer = load_tokenizer(args.model)
        max_model_len = args.max_model_len or _model_max_len(args.model)
        texts = load_alpaca_texts(args.dataset) if args.workload in ("alpaca", "mixed") else None
        requests = make_requests(
            args.workload,
            args.num_prompts,
            args.request_rate,
            tokenizer,
            seed=args.seed,
            burstiness=args.burstiness,
            max_model_len=max_model_len,
            max_output_len=args.max_output_len,
            random_input_len=args.random_input_len,
            random_output_len=args.random_output_len,
            random_range_ratio=args.random_range_ratio,
            online_share=online_share,
            alpaca_texts=texts,
            prompt_format=args.prompt_format,
        )
    except (FileNotFoundError, ValueError, ModelNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    result = asyncio.run(
        run_benchmark(
            args.base_url,
            requests,
            model=args.served_model_name or args.model,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            max_connections=args.max_connections,
            timeout_s=args.timeout_s,
            priority_format=args.priority_format,
            headers=headers,
            progress=not args.no_progress,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
        )
    )
    summary = {"workload": args.workload, "base_url": args.base_url, "seed": args.seed} | result.summary()
    summary["prompt_format"] = args.prompt_format
    report = write_report(
        args.out, f"Online benchmark: {args.workload} at {args.request_rate} req/s", summary, _table(summary)
    )
    # Per-request measurements go beside the report, one JSON object a line (too many for Markdown).
    per_request = report.with_suffix(".requests.jsonl")
    per_request.write_text("".join(json.dumps(o.to_dict()) + "\n" for o in result.outcomes))
    if not args.json:
        for row in _table(summary)[1:]:
            print(f"{row[0]:<22} {row[1]}")
        print(f"report: {report}, {report.with_suffix('.md')}, {per_request}")
    print(json.dumps(summary))
    return 0


def _table(s: dict[str, Any]) -> list[tuple[str, ...]]:
    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    rows = [("metric", "value")]
    rows += [
        ("requests", f"{s['completed']} completed, {s['failed']} failed of {s['num_requests']}"),
        ("request rate", f"{f(s['request_rate'])} req/s offered, {f(s['request_throughput_rps'])} served"),
        ("output tokens/s", f(s["output_tok_per_s"])),
        ("SLO", f"TTFT <= {f(s.get('slo_ttft_ms'))} ms, TPOT <= {f(s.get('slo_tpot_ms'))} ms"),
        ("SLO attainment", f(s["slo_attainment"])),
        ("goodput (req/s)", f(s["goodput_rps"])),
    ]
    for m in ("ttft", "tpot", "itl", "e2e"):
        rows.append((f"{m.upper()} ms p50/p90/p99", " / ".join(f(s[f"{m}_p{q}_ms"]) for q in (50, 90, 99))))
    for c, v in (s.get("classes") or {}).items():
        rows.append((f"{c} attainment", f"{f(v['slo_attainment'])} of {v['requests']}"))
    for e in s["errors"]:
        # A pipe in a message would split the Markdown table cell.
        rows.append(("error", f"{e['count']}x " + e["error"].replace("|", "\\|")))
    return rows
