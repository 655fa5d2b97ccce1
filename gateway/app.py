"""The OpenAI-compatible HTTP gateway: a FastAPI app over a :class:`ServingBackend`.

``create_app(backend, settings)`` builds the app around a live backend (tests, local serving);
``build_app(settings)`` wraps it as a Ray Serve ingress deployment whose replica builds its own
backend from ``settings.backend_factory``.

Per request: validate (400 naming the field), tokenize, check the context limit, hand one engine
``Request`` per prompt to the backend, stream tokens back (SSE) or collect them (JSON), and record
TTFT / TPOT / end-to-end latency. A client that goes away cancels the backend iterators and aborts
the requests, whether it was streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.request import FinishReason, PriorityClass, Request, RequestOutput, SamplingParams
from gateway.backend import BackendError, Overloaded, ServingBackend
from gateway.protocol import (
    SSE_DONE,
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    error_body,
    new_id,
    now_s,
    parse_body,
    sse,
)
from gateway.settings import GatewaySettings
from gateway.tokenization import IncrementalDetokenizer, Tokenizer, load_tokenizer
from monitor.records import RequestRecord

logger = logging.getLogger(__name__)

T = TypeVar("T")

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_ID_HEADER = "x-request-id"
# Tasks that finish a request's bookkeeping after its handler is gone; kept so they are not collected.
_BACKGROUND: set[asyncio.Task[Any]] = set()


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


# --------------------------------------------------------------------------- one generation


@dataclass
class Event:
    """What one backend output means to the client."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


@dataclass
class Generation:
    """One prompt's request in flight: its backend iterator, text state and timings."""

    backend: ServingBackend
    req: Request
    detok: IncrementalDetokenizer
    arrival_wall: float
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    recorded: bool = False
    _it: AsyncIterator[RequestOutput] | None = None
    _primed: RequestOutput | None = None
    _backend_done: bool = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    async def prime(self) -> None:
        """Submit and wait for the first output: admission errors surface here, before any byte is sent."""
        self._it = self.backend.generate(self.req).__aiter__()
        try:
            self._primed = await self._it.__anext__()
        except StopAsyncIteration:
            self._backend_done = True
            raise BackendError("the backend ended the request without output") from None
        except BackendError:
            self._backend_done = True  # refused before it started: nothing to abort
            raise

    async def events(self) -> AsyncIterator[Event]:
        if self._it is None:
            await self.prime()
        assert self._it is not None
        while not self.done:
            if self._primed is not None:
                out, self._primed = self._primed, None
            else:
                try:
                    out = await self._it.__anext__()
                except StopAsyncIteration:
                    self._backend_done = True
                    raise BackendError("the backend ended the request without finishing it") from None
            yield self._apply(out)

    def _apply(self, out: RequestOutput) -> Event:
        now = time.monotonic()
        if out.new_token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self.token_ids += out.new_token_ids
            self.logprobs += out.new_logprobs
        if out.finished:
            self._backend_done = True
            if out.finish_reason == FinishReason.ERROR:
                self.finish_reason = "error"
                self.error = out.error or "the request failed in the engine"
                raise BackendError(self.error)
        text = self.detok.add(out.new_token_ids, final=out.finished)
        if out.finished:
            self.finish_reason = str(out.finish_reason or FinishReason.STOP)
        elif self.detok.stopped:
            # A stop string showed up in text the engine has not cut yet: end it here.
            self.finish_reason = "stop"
        return Event(text, list(out.new_token_ids), list(out.new_logprobs), self.finish_reason)

    async def close(self) -> None:
        """Abort the backend request unless it finished; idempotent."""
        if self._backend_done:
            return
        self._backend_done = True
        if self.finish_reason is None:
            self.finish_reason = "abort"
        it = self._it
        if it is not None and hasattr(it, "aclose"):
            with contextlib.suppress(Exception):
                await it.aclose()  # type: ignore[attr-defined]
        try:
            await self.backend.abort(self.req.request_id)
        except Exception:
            logger.exception("abort of %s failed", self.req.request_id)

    def record(self) -> RequestRecord:
        end = time.monotonic()
        n = len(self.token_ids)
        ttft = self.first_token_at - self.arrival if self.first_token_at is not None else None
        tpot = (
            (self.last_token_at - self.first_token_at) / (n - 1)
            if n > 1 and self.first_token_at is not None and self.last_token_at is not None
            else None
        )
        reason = self.finish_reason if self.finish_reason in ("stop", "length", "abort", "error") else "error"
        ok = reason in ("stop", "length")
        slo_met = ok
        if ok and self.req.slo_ttft_ms is not None:
            slo_met = slo_met and ttft is not None and ttft * 1e3 <= self.req.slo_ttft_ms
        if ok and self.req.slo_tpot_ms is not None and tpot is not None:
            slo_met = slo_met and tpot * 1e3 <= self.req.slo_tpot_ms
        return RequestRecord(
            request_id=self.req.request_id,
            arrival=self.arrival_wall,
            priority_class=self.req.priority_class.value,
            prompt_tokens=self.req.num_prompt_tokens,
            output_tokens=n,
            finish_reason=reason,  # type: ignore[arg-type]
            slo_met=slo_met,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=end - self.arrival,
            error=self.error,
        )


async def _finish(backend: ServingBackend, gens: list[Generation]) -> None:
    """Abort what is unfinished and record every request once."""
    for g in gens:
        await g.close()
    for g in gens:
        if g.recorded or g._it is None:
            continue  # never admitted: nothing to record
        g.recorded = True
        try:
            await backend.record(g.record())
        except Exception:
            logger.exception("recording request %s failed", g.req.request_id)


async def _finish_shielded(backend: ServingBackend, gens: list[Generation]) -> None:
    """Run :func:`_finish` even when the caller is being cancelled (the client went away)."""
    task = asyncio.ensure_future(_finish(backend, gens))
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(task)


async def _wait_disconnect(request: HTTPRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(request: HTTPRequest, aw: Awaitable[T]) -> T:
    """Await ``aw`` unless the client disconnects first; then cancel it and raise :class:`ClientGone`."""
    work = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientGone()
    finally:
        for t in (work, watcher):
            if not t.done():
                t.cancel()
        # Let the cancelled work unwind (its backend iterators stop) before anyone closes them.
        with anyio.CancelScope(shield=True):
            await asyncio.wait({work, watcher})


async def _prime_all(gens: list[Generation]) -> None:
    tasks = [asyncio.ensure_future(g.prime()) for g in gens]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait(tasks)


async def _collect(g: Generation) -> None:
    async for _ in g.events():
        pass


async def _collect_all(gens: list[Generation]) -> None:
    tasks = [asyncio.ensure_future(_collect(g)) for g in gens]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait(tasks)


async def _merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Event]]:
    """Events of several generations as they come, tagged with the prompt index."""
    if len(gens) == 1:
        async for ev in gens[0].events():
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for ev in g.events():
                await queue.put((i, ev))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait(tasks)


class _StreamResponse(StreamingResponse):
    """SSE response that aborts and records its requests however the stream ends."""

    def __init__(self, content: AsyncIterator[str], backend: ServingBackend, gens: list[Generation]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._backend = backend
        self._gens = gens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _finish_shielded(self._backend, self._gens)


# --------------------------------------------------------------------------- the app


class _RequestIdMiddleware:
    """Echo the client's x-request-id (or a new one) on every response, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for k, v in scope.get("headers", []):
            if k == b"x-request-id":
                rid = v.decode("latin-1")[:256]
                break
        rid = rid or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


@dataclass
class _Scheduling:
    priority_class: PriorityClass
    priority_level: int
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None


class Gateway:
    """The request handling behind the routes; one per app."""

    def __init__(self, backend: ServingBackend, settings: GatewaySettings) -> None:
        self.backend = backend
        self.settings = settings
        self.info = backend.model_info()
        self.tokenizer = Tokenizer(load_tokenizer(self.info.path))

    # ---------------------------------------------------------------- checks

    def check_auth(self, request: HTTPRequest, allow_query: bool = False) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = None
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        elif allow_query:
            # The dashboard page is opened in a browser once with ?api_key=..., then sends the header.
            given = request.query_params.get("api_key")
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.info.name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.info.name!r}",
                param="model",
                code="model_not_found",
            )

    def scheduling(
        self, request: HTTPRequest, body: CompletionRequest | ChatCompletionRequest
    ) -> _Scheduling:
        pclass: str = self.settings.default_priority
        level = 0
        header = request.headers.get("x-priority")
        if header is not None:
            h = header.strip().lower()
            if h in ("online", "offline"):
                pclass = h
            else:
                try:
                    level = int(h)
                except ValueError:
                    raise APIError(
                        400,
                        f"x-priority header must be 'online', 'offline' or an integer, got {header!r}",
                        param="x-priority",
                    ) from None
        if body.priority is not None:
            pclass = body.priority
        if body.priority_level is not None:
            level = body.priority_level
        ttft = self._slo_header(request, "x-slo-ttft-ms")
        tpot = self._slo_header(request, "x-slo-tpot-ms")
        if pclass == "online":
            ttft = ttft if ttft is not None else self.settings.default_slo_ttft_ms
            tpot = tpot if tpot is not None else self.settings.default_slo_tpot_ms
        # Offline work is judged on throughput: it gets latency SLOs only when it asks for them.
        return _Scheduling(PriorityClass(pclass), level, ttft, tpot)

    @staticmethod
    def _slo_header(request: HTTPRequest, name: str) -> float | None:
        raw = request.headers.get(name)
        if raw is None:
            return None
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise APIError(
                400, f"{name} header must be a positive number of milliseconds, got {raw!r}", param=name
            )
        return value

    def check_length(self, ids: list[int], max_tokens: int | None, prompt_param: str, max_param: str) -> int:
        """The max_tokens to use; 400 naming max_model_len when the prompt or prompt + output does not fit."""
        limit = self.info.max_model_len
        if len(ids) >= limit:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens but max_model_len is {limit} "
                "(prompt + output must fit, with at least one output token)",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise APIError(
                400,
                f"{max_param} is too large: the prompt has {len(ids)} tokens and {max_param} is {max_tokens}, "
                f"{len(ids) + max_tokens} in all, beyond max_model_len {limit}",
                param=max_param,
                code="context_length_exceeded",
            )
        return max_tokens

    def sampling(
        self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: bool
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            stop=tuple(body.stop_list()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )

    def generations(
        self,
        base_id: str,
        prompts: list[list[int]],
        max_tokens: list[int],
        body: CompletionRequest | ChatCompletionRequest,
        sched: _Scheduling,
        logprobs: bool,
    ) -> list[Generation]:
        now = time.time()
        gens = []
        for i, (ids, mt) in enumerate(zip(prompts, max_tokens, strict=True)):
            req = Request(
                request_id=base_id if len(prompts) == 1 else f"{base_id}-{i}",
                prompt_token_ids=ids,
                sampling=self.sampling(body, mt, logprobs),
                priority_class=sched.priority_class,
                priority_level=sched.priority_level,
                slo_ttft_ms=sched.slo_ttft_ms,
                slo_tpot_ms=sched.slo_tpot_ms,
                eos_token_id=self.info.eos_token_ids[0] if self.info.eos_token_ids else None,
            )
            gens.append(
                Generation(self.backend, req, IncrementalDetokenizer(self.tokenizer, body.stop_list()), now)
            )
        return gens

    def token_label(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.tokenizer.token_text(token_id)

    # ---------------------------------------------------------------- completions

    async def completions(self, request: HTTPRequest) -> Response:
        self.check_auth(request)
        body: CompletionRequest = parse_body(CompletionRequest, await request.body())
        self.check_model(body.model)
        if body.logprobs is not None and body.logprobs > self.settings.max_logprobs:
            raise APIError(
                400,
                f"logprobs must be <= {self.settings.max_logprobs}, got {body.logprobs}",
                param="logprobs",
            )
        sched = self.scheduling(request, body)
        prompts: list[list[int]] = []
        for p in body.prompts():
            if isinstance(p, str):
                ids = self.tokenizer.encode(p)
                if not ids:
                    raise APIError(400, "prompt: the prompt is empty after tokenization", param="prompt")
            else:
                ids = p
                bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
                if bad:
                    raise APIError(
                        400,
                        f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.tokenizer.vocab_size})",
                        param="prompt",
                    )
            prompts.append(ids)
        max_tokens = [self.check_length(ids, body.max_tokens, "prompt", "max_tokens") for ids in prompts]
        want_lp = body.logprobs is not None
        gens = self.generations(new_id("cmpl"), prompts, max_tokens, body, sched, want_lp)
        base_id = gens[0].req.request_id
        if body.stream:
            return await self._stream(request, gens, lambda: self._completion_chunks(body, gens, base_id))
        try:
            await _until_disconnect(request, _collect_all(gens))
        finally:
            await _finish_shielded(self.backend, gens)
        choices = []
        for i, g in enumerate(gens):
            prefix = self.tokenizer.decode(g.req.prompt_token_ids) if body.echo else ""
            choices.append(
                CompletionChoice(
                    index=i,
                    text=prefix + g.detok.output_text,
                    logprobs=self._completion_logprobs(
                        g, body, prefix, g.token_ids, g.logprobs, echo=body.echo
                    )
                    if want_lp
                    else None,
                    finish_reason=g.finish_reason,
                )
            )
        usage = Usage.of(sum(g.req.num_prompt_tokens for g in gens), sum(len(g.token_ids) for g in gens))
        resp = CompletionResponse(
            id=base_id, created=now_s(), model=self.info.name, choices=choices, usage=usage
        )
        return JSONResponse(resp.model_dump())

    def _completion_logprobs(
        self,
        g: Generation,
        body: CompletionRequest,
        prefix_text: str,
        token_ids: list[int],
        logprobs: list[float],
        echo: bool,
        offset: int = 0,
    ) -> CompletionLogprobs:
        as_ids = body.return_tokens_as_token_ids
        tokens: list[str] = []
        lps: list[float | None] = []
        if echo:
            # The engine computes no prompt logprobs: the prompt's tokens are listed with null.
            tokens += [self.token_label(t, as_ids) for t in g.req.prompt_token_ids]
            lps += [None] * len(g.req.prompt_token_ids)
        tokens += [self.token_label(t, as_ids) for t in token_ids]
        lps += list(logprobs) + [None] * (len(token_ids) - len(logprobs))
        offsets = []
        pos = offset if not echo else 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top = (
            [({t: lp} if lp is not None else None) for t, lp in zip(tokens, lps, strict=True)]
            if body.logprobs
            else None
        )
        return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=top, text_offset=offsets)

    async def _completion_chunks(
        self, body: CompletionRequest, gens: list[Generation], rid: str
    ) -> AsyncIterator[str]:
        created = now_s()
        model = self.info.name
        want_lp = body.logprobs is not None
        offsets = [0] * len(gens)

        def chunk(i: int, text: str, lp: CompletionLogprobs | None, finish: str | None) -> str:
            c = CompletionResponse(
                id=rid,
                created=created,
                model=model,
                choices=[CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=finish)],
            )
            return sse(c)

        if body.echo:
            for i, g in enumerate(gens):
                prefix = self.tokenizer.decode(g.req.prompt_token_ids)
                lp = self._completion_logprobs(g, body, prefix, [], [], echo=True) if want_lp else None
                yield chunk(i, prefix, lp, None)
        async for i, ev in _merged(gens):
            if not (ev.text or ev.finish_reason or (want_lp and ev.token_ids)):
                continue
            lp = None
            if want_lp:
                lp = self._completion_logprobs(
                    gens[i], body, "", ev.token_ids, ev.logprobs, echo=False, offset=offsets[i]
                )
            offsets[i] += len(ev.text)
            yield chunk(i, ev.text, lp, ev.finish_reason)
        if body.include_usage():
            usage = Usage.of(sum(g.req.num_prompt_tokens for g in gens), sum(len(g.token_ids) for g in gens))
            yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage))

    # ---------------------------------------------------------------- chat

    async def chat(self, request: HTTPRequest) -> Response:
        self.check_auth(request)
        body: ChatCompletionRequest = parse_body(ChatCompletionRequest, await request.body())
        self.check_model(body.model)
        if body.top_logprobs and body.top_logprobs > self.settings.max_logprobs:
            raise APIError(400, f"top_logprobs must be <= {self.settings.max_logprobs}", param="top_logprobs")
        sched = self.scheduling(request, body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, body.add_generation_prompt)
        except Exception as e:  # template errors (role order, ...) are the client's to fix
            raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
        if not ids:
            raise APIError(400, "messages: empty after applying the chat template", param="messages")
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        mt = self.check_length(ids, body.requested_max_tokens(), "messages", max_param)
        gens = self.generations(new_id("chatcmpl"), [ids], [mt], body, sched, body.logprobs)
        g = gens[0]
        rid = g.req.request_id
        if body.stream:
            return await self._stream(request, gens, lambda: self._chat_chunks(body, g, rid))
        try:
            await _until_disconnect(request, _collect_all(gens))
        finally:
            await _finish_shielded(self.backend, gens)
        resp = ChatCompletionResponse(
            id=rid,
            created=now_s(),
            model=self.info.name,
            choices=[
                ChatChoice(
                    index=0,
                    message=ChatResponseMessage(content=g.detok.output_text),
                    logprobs=self._chat_logprobs(g.token_ids, g.logprobs) if body.logprobs else None,
                    finish_reason=g.finish_reason,
                )
            ],
            usage=Usage.of(g.req.num_prompt_tokens, len(g.token_ids)),
        )
        return JSONResponse(resp.model_dump())

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[float]) -> ChatLogprobs:
        items = []
        for t, lp in zip(token_ids, logprobs, strict=False):
            text = self.tokenizer.token_text(t)
            items.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=lp,
                    bytes=list(text.encode()),
                    top_logprobs=[{"token": text, "logprob": lp, "bytes": list(text.encode())}],
                )
            )
        return ChatLogprobs(content=items)

    async def _chat_chunks(self, body: ChatCompletionRequest, g: Generation, rid: str) -> AsyncIterator[str]:
        created = now_s()
        model = self.info.name

        def chunk(delta: ChatDelta, finish: str | None, lp: ChatLogprobs | None = None) -> str:
            return sse(
                ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=model,
                    choices=[ChatChunkChoice(index=0, delta=delta, logprobs=lp, finish_reason=finish)],
                )
            )

        yield chunk(ChatDelta(role="assistant", content=""), None)
        async for _, ev in _merged([g]):
            if not (ev.text or ev.finish_reason or (body.logprobs and ev.token_ids)):
                continue
            lp = self._chat_logprobs(ev.token_ids, ev.logprobs) if body.logprobs else None
            yield chunk(ChatDelta(content=ev.text) if ev.text else ChatDelta(), ev.finish_reason, lp)
        if body.include_usage():
            usage = Usage.of(g.req.num_prompt_tokens, len(g.token_ids))
            yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=usage))

    # ---------------------------------------------------------------- streaming

    async def _stream(
        self,
        request: HTTPRequest,
        gens: list[Generation],
        make_chunks: Callable[[], AsyncIterator[str]],
    ) -> Response:
        # Wait for admission and the first token before answering 200, so that a full queue is a
        # real 429 and a refused request a real 4xx, not an error inside a 200 stream.
        try:
            await _until_disconnect(request, _prime_all(gens))
        except BaseException:
            await _finish_shielded(self.backend, gens)
            raise

        async def body() -> AsyncIterator[str]:
            try:
                async for piece in make_chunks():
                    yield piece
            except BackendError as e:
                # Headers are gone already: report in the stream, as OpenAI-compatible servers do.
                yield sse(
                    error_body(
                        str(e), "server_error" if e.status >= 500 else "invalid_request_error", code=e.code
                    )
                )
            yield SSE_DONE

        return _StreamResponse(body(), self.backend, gens)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _backend_error(e: BackendError) -> APIError:
    headers = {}
    if isinstance(e, Overloaded):
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
    kind = {400: "invalid_request_error", 429: "rate_limit_error"}.get(e.status, "server_error")
    return APIError(e.status, str(e) or e.code, type=kind, code=e.code, headers=headers)


def create_app(
    backend: ServingBackend, settings: GatewaySettings | None = None, *, echo_request_id: bool = True
) -> FastAPI:
    """The gateway app over a live backend; the caller keeps ownership of the backend (shuts it down).

    ``echo_request_id=False`` leaves x-request-id to a proxy in front that already echoes it (Ray
    Serve's does, and generates one when absent), so responses do not carry it twice.
    """
    settings = settings or GatewaySettings()
    gw = Gateway(backend, settings)
    app = FastAPI(title="BucketServe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw

    @app.exception_handler(APIError)
    async def _api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(BackendError)
    async def _backend_exc(_: HTTPRequest, exc: BackendError) -> JSONResponse:
        return _error_response(_backend_error(exc))

    @app.exception_handler(ClientGone)
    async def _gone(_: HTTPRequest, exc: ClientGone) -> Response:
        # Nobody is listening; 499 is the usual log marker for "client closed request".
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "header")]
        param = ".".join(loc) or None
        msg = (
            f"{param}: {err.get('msg', 'invalid value')}" if param else str(err.get("msg", "invalid request"))
        )
        return _error_response(APIError(400, msg, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(_: HTTPRequest, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in the gateway")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Response:
        return await gw.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Response:
        return await gw.chat(request)

    @app.get("/v1/models")
    async def models(request: HTTPRequest) -> JSONResponse:
        gw.check_auth(request)
        card = ModelCard(id=gw.info.name, created=now_s(), max_model_len=gw.info.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            state = await backend.health()
        except Exception as e:
            return JSONResponse({"ready": False, "error": f"{type(e).__name__}: {e}"}, status_code=503)
        return JSONResponse(state, status_code=200 if state.get("ready") else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await backend.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/dashboard")
    async def dashboard(request: HTTPRequest) -> HTMLResponse:
        gw.check_auth(request, allow_query=True)
        from monitor.dashboard import page_html

        return HTMLResponse(page_html("/dashboard/data", settings.dashboard_refresh_ms))

    @app.get("/dashboard/data")
    async def dashboard_data(request: HTTPRequest, window_s: float = 900.0) -> JSONResponse:
        gw.check_auth(request, allow_query=True)
        if not math.isfinite(window_s) or window_s <= 0:
            raise APIError(400, f"window_s must be a positive number, got {window_s}", param="window_s")
        return JSONResponse(await backend.dashboard_data(window_s))

    if echo_request_id:
        app.add_middleware(_RequestIdMiddleware)
    return app


# --------------------------------------------------------------------------- Ray Serve


@serve.ingress()
class GatewayDeployment:
    """Ray Serve ingress: each replica builds (or connects to) its backend, then its app."""

    def __init__(self, settings: GatewaySettings) -> None:
        self._settings = settings
        self._backend = settings.build_backend()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self._backend, self._settings, echo_request_id=False)

    async def __del__(self) -> None:
        # The app does not own its backend (tests share one); the replica that built it does.
        await self._backend.shutdown()


def build_app(settings: GatewaySettings, **deployment_options: Any) -> serve.Application:
    """The gateway as a Ray Serve application: ``serve.run(build_app(settings), route_prefix="/")``.

    ``deployment_options`` go to ``serve.deployment`` (``num_replicas``, ``ray_actor_options``, ...).
    Streams are long-lived, so a replica takes many requests at once by default.
    """
    if settings.backend_factory is None:
        raise ValueError(
            "build_app needs GatewaySettings.backend_factory: each replica builds its backend with it"
        )
    options = {"name": "gateway", "max_ongoing_requests": 1024, **deployment_options}
    return serve.deployment(GatewayDeployment, **options).bind(settings)
