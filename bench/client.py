"""The online load generator of ``bucketserve bench serve``: a streaming client for any OpenAI-compatible server.

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
the command builds the requests from a workload (:mod:`bench.workload_requests`) and calls it. What
it measures is defined in :mod:`bench.metrics`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from typing import Any

import httpx

from bench.metrics import BenchResult, RequestOutcome
from bench.workload_requests import PRIORITY_CLASSES, BenchRequest

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
