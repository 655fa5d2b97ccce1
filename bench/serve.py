"""``bucketserve bench serve``: an online load generator for any OpenAI-compatible server.

Requests go out as streaming ``/v1/completions`` (``stream: true``, ``ignore_eos: true``,
``max_tokens`` = the output length, ``stream_options.include_usage``) at Poisson arrivals (gamma with
``--burstiness``), each with the SLO headers ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` and, with
``--priority-mix``, a ``priority`` class. Per request it measures TTFT, TPOT, the inter-token latencies
and the end-to-end latency; over the run, throughput, SLO attainment and goodput.

Prompts are sent as **text**: each is cut to exactly the sampled number of tokens of the model's
tokenizer and checked to tokenize back to that count (without special tokens; a server that adds a
BOS token sees one more). Text works with every OpenAI-compatible server; ``--prompt-format token-ids``
sends the token ids instead, for servers that accept them.

The reusable core is :func:`run_benchmark` (an async function over a list of :class:`BenchRequest`);
the command builds the requests from a workload and calls it.

Definitions (the same as common serving benchmarks):

* TTFT: from the moment the request is due to the first streamed token. The clock starts before the
  client waits for a free connection, as a user's would; that wait is reported as ``pool_wait``.
* TPOT: ``(e2e - TTFT) / (output_tokens - 1)``, the mean time per token after the first; a request of
  one output token has no TPOT and meets any TPOT bound.
* ITL: the gaps between consecutive streamed chunks carrying tokens.
* Output tokens: the server's ``usage.completion_tokens`` when it reports usage, else the number of
  chunks carrying tokens.
* A request meets its SLO when it succeeded, TTFT <= the TTFT bound and TPOT <= the TPOT bound. SLO
  attainment is over all requests (a failure counts as a miss); goodput is SLO-meeting requests per
  second of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = REPO_ROOT.parent / "shared" / "data" / "alpaca_seed_tasks.jsonl"
PRIORITY_CLASSES = ("online", "offline")
# How many distinct failure messages the summary lists.
MAX_ERRORS_SHOWN = 5


# --------------------------------------------------------------------------- data


@dataclass
class BenchRequest:
    """One request to send. ``send_at`` is seconds after the benchmark starts."""

    prompt: str | list[int]
    input_len: int
    output_len: int
    send_at: float = 0.0
    priority: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    request_id: str = ""


@dataclass
class RequestOutcome:
    """What one request measured. Times are seconds; ``start_s`` is relative to the benchmark start."""

    request_id: str
    priority: str | None
    input_len: int
    expected_output_len: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    start_s: float = 0.0
    pool_wait_s: float = 0.0
    success: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    token_chunks: int = 0
    usage_reported: bool = False
    server_prompt_tokens: int | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def meets_slo(self) -> bool:
        if not self.success or self.ttft_s is None:
            return False
        tpot = self.tpot_s
        return self.ttft_s * 1e3 <= self.slo_ttft_ms and (tpot is None or tpot * 1e3 <= self.slo_tpot_ms)

    def to_dict(self) -> dict[str, Any]:
        tpot = self.tpot_s
        return {
            "request_id": self.request_id,
            "priority": self.priority,
            "input_len": self.input_len,
            "expected_output_len": self.expected_output_len,
            "success": self.success,
            "error": self.error,
            "start_s": round(self.start_s, 6),
            "ttft_ms": _ms(self.ttft_s),
            "tpot_ms": _ms(tpot),
            "e2e_ms": _ms(self.e2e_s),
            "output_tokens": self.output_tokens,
            "server_prompt_tokens": self.server_prompt_tokens,
            "meets_slo": self.meets_slo(),
        }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1e3, 3)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks; ``None`` when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(prefix: str, seconds: list[float]) -> dict[str, float | None]:
    ms = [s * 1e3 for s in seconds]
    out: dict[str, float | None] = {f"{prefix}_mean_ms": sum(ms) / len(ms) if ms else None}
    for q in (50, 90, 99):
        out[f"{prefix}_p{q}_ms"] = percentile(ms, q)
    return {k: None if v is None else round(v, 3) for k, v in out.items()}


@dataclass
class BenchResult:
    outcomes: list[RequestOutcome]
    duration_s: float
    request_rate: float | None = None
    burstiness: float | None = None
    # CPU this client used while sending (a client on the server's machine competes for its cores)
    client_cpu_s: float | None = None

    def summary(self) -> dict[str, Any]:
        """Aggregates over the run: throughput, SLO attainment, goodput, latency percentiles, failures."""
        done = [o for o in self.outcomes if o.success]
        failed = [o for o in self.outcomes if not o.success]
        met = [o for o in self.outcomes if o.meets_slo()]
        dur = self.duration_s if self.duration_s > 0 else float("nan")
        n = len(self.outcomes)
        out_tokens = sum(o.output_tokens for o in done)
        rate = self.request_rate
        summary: dict[str, Any] = {
            "request_rate": None if rate is None else ("inf" if math.isinf(rate) else rate),
            "burstiness": self.burstiness,
            "num_requests": n,
            "completed": len(done),
            "failed": len(failed),
            "duration_s": round(self.duration_s, 4),
            "request_throughput_rps": _round(len(done) / dur),
            "output_tok_per_s": _round(out_tokens / dur),
            "total_input_tokens": sum(o.input_len for o in done),
            "total_output_tokens": out_tokens,
            "slo_attainment": _round(len(met) / n) if n else None,
            "goodput_rps": _round(len(met) / dur),
            "client_cpu_s": None if self.client_cpu_s is None else round(self.client_cpu_s, 3),
        }
        slos = {(o.slo_ttft_ms, o.slo_tpot_ms) for o in self.outcomes}
        if len(slos) == 1:
            summary["slo_ttft_ms"], summary["slo_tpot_ms"] = next(iter(slos))
        summary |= _stats("ttft", [o.ttft_s for o in done if o.ttft_s is not None])
        summary |= _stats("tpot", [t for o in done if (t := o.tpot_s) is not None])
        summary |= _stats("itl", [x for o in done for x in o.itl_s])
        summary |= _stats("e2e", [o.e2e_s for o in done if o.e2e_s is not None])
        # Time spent waiting for a free connection: large values mean the client, not the server, queued.
        wait = _stats("pool_wait", [o.pool_wait_s for o in self.outcomes])
        summary |= {k: v for k, v in wait.items() if k.endswith(("_mean_ms", "_p99_ms"))}
        summary["usage_reported"] = sum(o.usage_reported for o in done)
        summary["prompt_len_mismatch"] = sum(
            o.server_prompt_tokens is not None and o.server_prompt_tokens != o.input_len for o in done
        )
        summary["short_outputs"] = sum(o.output_tokens < o.expected_output_len for o in done)
        classes = sorted({o.priority for o in self.outcomes if o.priority is not None})
        if classes:
            per_class = {}
            for c in classes:
                mine = [o for o in self.outcomes if o.priority == c]
                c_met = sum(o.meets_slo() for o in mine)
                c_done = [o for o in mine if o.success]
                per_class[c] = {
                    "requests": len(mine),
                    "completed": len(c_done),
                    "slo_attainment": _round(c_met / len(mine)),
                    "goodput_rps": _round(c_met / dur),
                    **_stats("ttft", [o.ttft_s for o in c_done if o.ttft_s is not None]),
                    **_stats("tpot", [t for o in c_done if (t := o.tpot_s) is not None]),
                }
                summary[f"slo_attainment_{c}"] = per_class[c]["slo_attainment"]
            summary["classes"] = per_class
        errors = Counter(o.error or "unknown error" for o in failed)
        summary["errors"] = [{"error": e, "count": c} for e, c in errors.most_common(MAX_ERRORS_SHOWN)]
        return summary


def _round(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


# --------------------------------------------------------------------------- one request


def _error_text(body: bytes, limit: int = 300) -> str:
    """The message of an OpenAI-shaped error body (``{"error": {"message": ...}}``), else the raw text."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:limit]
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:limit]
        if isinstance(err, str):
            return err[:limit]
        if doc.get("detail"):
            return str(doc["detail"])[:limit]
    return json.dumps(doc)[:limit]


def _exc_text(e: BaseException) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


class _SSEError(Exception):
    pass


def _is_token_chunk(choice: dict[str, Any]) -> bool:
    # A chunk carries a token when it has text; an empty-text chunk that only closes the stream
    # (finish_reason set) does not. Empty text without finish_reason is a token whose bytes are not
    # yet a whole character (some servers hold them back and send "").
    text = choice.get("text")
    if text is None:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
    if text:
        return True
    return text is not None and choice.get("finish_reason") is None


async def _send_one(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    outcome: RequestOutcome,
    slots: asyncio.Semaphore,
) -> None:
    """Send one streaming request and fill ``outcome``. Never raises for a server or network fault."""
    start = time.perf_counter()
    try:
        async with slots:
            outcome.pool_wait_s = time.perf_counter() - start
            async with client.stream("POST", url, json=payload, headers=headers) as resp:
                if resp.status_code != 200:
                    body = await resp.aread()
                    outcome.error = f"HTTP {resp.status_code}: {_error_text(body)}"
                    return
                await _read_stream(resp, start, outcome)
    except _SSEError as e:
        outcome.error = str(e)
    except (httpx.HTTPError, OSError) as e:
        outcome.error = _exc_text(e)
    except asyncio.CancelledError:
        outcome.error = "cancelled"
        raise


async def _read_stream(resp: httpx.Response, start: float, outcome: RequestOutcome) -> None:
    last: float | None = None
    done = False
    pending: list[str] = []  # data lines of an event that is not yet a whole JSON document
    async for line in resp.aiter_lines():
        now = time.perf_counter()
        if not line.strip():
            pending.clear()  # an event ends at a blank line; whatever did not parse is dropped
            continue
        if line.startswith(":") or not line.startswith("data:"):
            continue  # SSE comments (keep-alives), event:/id:/retry: fields
        data = line[5:].removeprefix(" ")
        if data.strip() == "[DONE]":
            done = True
            break
        pending.append(data)
        try:
            chunk = json.loads("\n".join(pending))
        except ValueError:
            continue  # a data field split across lines: wait for the rest of the event
        pending.clear()
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk or chunk.get("object") == "error":
            raise _SSEError(f"stream error: {_error_text(json.dumps(chunk).encode())}")
        choices = chunk.get("choices") or []
        if choices and isinstance(choices[0], dict) and _is_token_chunk(choices[0]):
            if last is None:
                outcome.ttft_s = now - start
            else:
                outcome.itl_s.append(now - last)
            last = now
            outcome.token_chunks += 1
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            outcome.usage_reported = True
            outcome.output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                outcome.server_prompt_tokens = int(usage["prompt_tokens"])
    if not done:
        raise _SSEError("stream ended without [DONE]")
    if last is None:
        raise _SSEError("stream ended without any token")
    outcome.e2e_s = last - start
    if not outcome.usage_reported:
        outcome.output_tokens = outcome.token_chunks
    outcome.success = True


# --------------------------------------------------------------------------- the run


async def run_benchmark(
    base_url: str,
    requests: list[BenchRequest],
    *,
    model: str | None = None,
    slo_ttft_ms: float = 450.0,
    slo_tpot_ms: float = 50.0,
    max_connections: int = 256,
    timeout_s: float = 600.0,
    priority_format: str = "name",
    headers: dict[str, str] | None = None,
    extra_body: dict[str, Any] | None = None,
    progress: bool = True,
    request_rate: float | None = None,
    burstiness: float | None = None,
) -> BenchResult:
    """Send ``requests`` at their ``send_at`` times to ``base_url`` (``http://host:port``, with or without
    ``/v1``) and measure each. A request's own SLOs, when set, override ``slo_ttft_ms``/``slo_tpot_ms``.

    ``max_connections`` bounds the open connections (and requests in flight); ``timeout_s`` is the
    longest wait for any one read or connect. ``priority_format`` ``name`` sends ``priority`` as
    ``"online"``/``"offline"`` (this product); ``int`` sends 0/1 (vLLM, lower first)."""
    if priority_format not in ("name", "int"):
        raise ValueError(f"priority_format must be 'name' or 'int', got {priority_format!r}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
    root = base_url.rstrip("/")
    url = (root if root.endswith("/v1") else root + "/v1") + "/completions"
    outcomes = [
        RequestOutcome(
            request_id=r.request_id or f"bench-{i}",
            priority=r.priority,
            input_len=r.input_len,
            expected_output_len=r.output_len,
            slo_ttft_ms=r.slo_ttft_ms if r.slo_ttft_ms is not None else slo_ttft_ms,
            slo_tpot_ms=r.slo_tpot_ms if r.slo_tpot_ms is not None else slo_tpot_ms,
        )
        for i, r in enumerate(requests)
    ]
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    # No pool timeout: a request waiting for a connection is late, not failed (the wait is measured).
    timeout = httpx.Timeout(timeout_s, pool=None)
    client_args = {"limits": limits, "timeout": timeout, "headers": headers or {}}
    slots = asyncio.Semaphore(max_connections)
    bar = _progress(len(requests), progress)
    # A full garbage collection over a large heap (torch and transformers are loaded for the tokenizer)
    # stops the process for hundreds of milliseconds, which would land in some request's latency.
    # Collect now and move every surviving object out of the collector's view for the run.
    gc.collect()
    gc.freeze()
    cpu0 = time.process_time()
    try:
        duration = await _drive(
            url, requests, outcomes, model, priority_format, extra_body, client_args, slots, bar
        )
    finally:
        gc.unfreeze()
    return BenchResult(
        outcomes=outcomes,
        duration_s=duration,
        request_rate=request_rate,
        burstiness=burstiness,
        client_cpu_s=time.process_time() - cpu0,
    )


async def _drive(
    url: str,
    requests: list[BenchRequest],
    outcomes: list[RequestOutcome],
    model: str | None,
    priority_format: str,
    extra_body: dict[str, Any] | None,
    client_args: dict[str, Any],
    slots: asyncio.Semaphore,
    bar: Any,
) -> float:
    """Send every request at its time; returns the run's duration in seconds."""
    async with httpx.AsyncClient(**client_args) as client:
        t0 = time.perf_counter()

        async def one(req: BenchRequest, outcome: RequestOutcome) -> None:
            delay = t0 + req.send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome.start_s = time.perf_counter() - t0
            payload = _payload(req, model, priority_format, extra_body)
            hdrs = {
                "x-slo-ttft-ms": _num(outcome.slo_ttft_ms),
                "x-slo-tpot-ms": _num(outcome.slo_tpot_ms),
                "x-request-id": outcome.request_id,
            }
            await _send_one(client, url, payload, hdrs, outcome, slots)
            if bar is not None:
                bar.update(1)

        try:
            await asyncio.gather(*(one(r, o) for r, o in zip(requests, outcomes, strict=True)))
        finally:
            if bar is not None:
                bar.close()
        # The run ends with the last token of the last request (or the last failure).
        return time.perf_counter() - t0


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _payload(
    req: BenchRequest, model: str | None, priority_format: str, extra_body: dict[str, Any] | None
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    if model is not None:
        payload["model"] = model
    if req.priority is not None:
        payload["priority"] = (
            req.priority if priority_format == "name" else PRIORITY_CLASSES.index(req.priority)
        )
    if extra_body:
        payload |= extra_body
    return payload


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True)


# --------------------------------------------------------------------------- building requests


def parse_priority_mix(spec: str | None) -> float | None:
    """``"online:offline"`` weights (e.g. ``3:1``) -> the share of online requests; ``None`` -> None."""
    if spec is None:
        return None
    parts = spec.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        on, off = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"--priority-mix must be ONLINE:OFFLINE weights such as 3:1, got {spec!r}") from None
    if on < 0 or off < 0 or on + off <= 0 or not math.isfinite(on + off):
        raise ValueError(f"--priority-mix weights must be >= 0 and not both 0, got {spec!r}")
    return on / (on + off)


def assign_priorities(n: int, online_share: float | None, seed: int) -> list[str | None]:
    """Each request's class, drawn with the given share of ``online``; reproducible from ``seed``."""
    if online_share is None:
        return [None] * n
    rng = random.Random(f"priority:{seed}")
    return ["online" if rng.random() < online_share else "offline" for _ in range(n)]


def make_requests(
    workload: str,
    num_prompts: int,
    request_rate: float,
    tokenizer: Any,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    max_model_len: int = 4096,
    max_output_len: int = 1024,
    random_input_len: int = 256,
    random_output_len: int = 64,
    random_range_ratio: float = 0.9,
    online_share: float | None = None,
    alpaca_texts: list[str] | None = None,
    prompt_format: str = "text",
) -> list[BenchRequest]:
    """The requests of a workload: lengths, exact-length prompts, arrival times and classes, all seeded."""
    from bench.workloads import build_prompts, sample_arrivals, sample_lengths

    if prompt_format not in ("text", "token-ids"):
        raise ValueError(f"prompt_format must be 'text' or 'token-ids', got {prompt_format!r}")
    lengths = sample_lengths(
        workload,
        num_prompts,
        seed,
        max_model_len=max_model_len,
        max_output_len=max_output_len,
        random_input_len=random_input_len,
        random_output_len=random_output_len,
        random_range_ratio=random_range_ratio,
    )
    prompts = build_prompts(workload, lengths, tokenizer, seed, alpaca_texts)
    arrivals = sample_arrivals(num_prompts, request_rate, seed, burstiness)
    classes = assign_priorities(num_prompts, online_share, seed)
    return [
        BenchRequest(
            prompt=p.text if prompt_format == "text" else list(p.token_ids),
            input_len=p.input_len,
            output_len=p.output_len,
            send_at=t,
            priority=c,
            request_id=f"bench-{i}",
        )
        for i, (p, t, c) in enumerate(zip(prompts, arrivals, classes, strict=True))
    ]


# --------------------------------------------------------------------------- command line


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
    from bench.workloads import WORKLOADS

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
