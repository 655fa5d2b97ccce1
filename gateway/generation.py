"""One prompt's request in flight through the gateway: submit it, turn backend outputs into text events, stop
it when the client goes away, and record its timings once it ends.

A client that disconnects cancels the backend iterators and aborts the requests, whether it was streaming
or not; the abort and the record run shielded, so a cancelled handler still finishes its bookkeeping. A request
that passes its deadline (``gateway/deadline.py``) takes the same path: every wait for the backend's next output
is bounded by it, and past it the request ends with :class:`gateway.backend.TimedOut` and is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi.responses import StreamingResponse
from starlette.requests import Request as HTTPRequest
from starlette.types import Receive, Scope, Send

from engine.request import FinishReason, Request, RequestOutput
from gateway.backend import BackendError, ServingBackend, TimedOut, Unavailable
from gateway.deadline import Deadline
from gateway.tokenization import IncrementalDetokenizer, Tokenizer
from monitor import stages
from monitor.records import RequestRecord

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Tasks that finish a request's bookkeeping after its handler is gone; kept so they are not collected.
_BACKGROUND: set[asyncio.Task[Any]] = set()

# The most an answer waits for its requests' abort and record; past it they go on in the background, so a
# controller or monitor that stopped answering cannot hold the client's answer (a 408 above all).
FINISH_WAIT_S = 5.0
# A stream past its deadline has this long to send its timeout error and [DONE]; a client that does not read
# them by then (the send is stuck) is cut off, so no stream outlives its deadline by more.
STREAM_GRACE_S = 5.0


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


@dataclass
class Event:
    """What one backend output means to the client."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None

    @property
    def streams(self) -> bool:
        """Whether a stream sends a chunk for it: every step that produced tokens does, its text empty while the
        detokenizer holds it back (an incomplete UTF-8 character, a possible stop string), so a client sees the
        first token when it comes and the stream's progress, even through output that only decodes at its end."""
        return bool(self.text or self.finish_reason or self.token_ids)


@dataclass
class Generation:
    """One prompt's request in flight: its backend iterator, text state and timings."""

    backend: ServingBackend
    req: Request
    detok: IncrementalDetokenizer
    arrival_wall: float
    # Past it, waiting for the next output raises TimedOut (None: no deadline).
    deadline: Deadline | None = None
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    # Stage marks (``monitor/stages.py``) from the processes the request went through, Unix seconds.
    marks: dict[str, float] = field(default_factory=dict)
    recorded: bool = False
    # Set when the server ends this request before it finishes (a drain period ran out, ``gateway/drain.py``):
    # the abort that follows is then an error the client sees, not a finish.
    cut: str | None = None
    _it: AsyncIterator[RequestOutput] | None = None
    _primed: RequestOutput | None = None
    _backend_done: bool = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def ended(self) -> bool:
        """The backend no longer runs it: finished, failed, refused or aborted."""
        return self._backend_done

    @property
    def submitted(self) -> bool:
        """The request was handed to the backend (admitted or not)."""
        return self._it is not None

    async def prime(self) -> None:
        """Submit and wait for the first output: admission errors surface here, before any byte is sent."""
        if self.cut is not None:
            self._backend_done = True  # cut before it reached the backend: nothing to abort
            raise Unavailable(self.cut)
        self._it = self.backend.generate(self.req).__aiter__()
        try:
            self._primed = await self._next()
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
                    out = await self._next()
                except StopAsyncIteration:
                    self._backend_done = True
                    raise BackendError("the backend ended the request without finishing it") from None
            yield self._apply(out)

    async def _next(self) -> RequestOutput:
        """The backend's next output, waited for until the deadline at most. Past it the backend iterator is
        cancelled (its own clean-up aborts the request), and :meth:`close` aborts it once more."""
        assert self._it is not None
        if self.deadline is None:
            return await self._it.__anext__()
        try:
            return await self.deadline.bound(self._it.__anext__())
        except TimedOut as e:
            self.finish_reason = "error"
            self.error = str(e)
            raise

    async def collect(self) -> None:
        """Run to the end, keeping the text and tokens (a response that is not streamed)."""
        async for _ in self.events():
            pass

    def _apply(self, out: RequestOutput) -> Event:
        now = time.monotonic()
        if out.marks:
            self.marks.update(out.marks)
        if out.new_token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                self.marks[stages.FIRST_TOKEN] = self.arrival_wall + (now - self.arrival)
            self.last_token_at = now
            self.token_ids += out.new_token_ids
            self.logprobs += out.new_logprobs
        if out.finished:
            self._backend_done = True
            if self.cut is not None and out.finish_reason == FinishReason.ABORT:
                self.finish_reason = "error"
                self.error = self.cut
                raise Unavailable(self.cut)
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
        spent = stages.stage_seconds({stages.RECEIVED: self.arrival_wall, **self.marks})
        waited = [spent[s] for s in ("controller_queue", "prefill_queue") if s in spent]
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
            queue_s=sum(waited) if waited else None,
            prefill_s=spent.get("prefill_forward"),
            stages=spent or None,
            error=self.error,
        )


def start_generations(
    backend: ServingBackend,
    reqs: list[Request],
    tokenizer: Tokenizer,
    stop: list[str],
    deadline: Deadline | None = None,
    received: float | None = None,
) -> list[Generation]:
    """One :class:`Generation` per request of one HTTP call, all bound by its deadline; ``received``: when the
    call came in (``time.monotonic()``; None: now), where its time to first token starts."""
    now = time.monotonic()
    received = now if received is None else received
    wall = time.time() - (now - received)
    return [
        Generation(backend, req, IncrementalDetokenizer(tokenizer, stop), wall, deadline, arrival=received)
        for req in reqs
    ]


async def _finish(backend: ServingBackend, gens: list[Generation]) -> None:
    """Abort what is unfinished, and record every request once without waiting for the records to be stored."""
    for g in gens:
        await g.close()
    records = []
    for g in gens:
        if g.recorded or not g.submitted:
            continue  # never admitted: nothing to record
        g.recorded = True
        records.append(g.record())
    if records:
        # The monitor and its store (Redis) are for operators and planning: a response never waits on them.
        _in_background(_record(backend, records))


async def _record(backend: ServingBackend, records: list[RequestRecord]) -> None:
    for rec in records:
        try:
            await backend.record(rec)
        except Exception:
            logger.exception("recording request %s failed", rec.request_id)


def _in_background(aw: Awaitable[None]) -> asyncio.Task[None]:
    task = asyncio.ensure_future(aw)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


async def finish_shielded(backend: ServingBackend, gens: list[Generation]) -> None:
    """Abort what is unfinished and record every request once, even when the caller is being cancelled
    (the client went away); waits ``FINISH_WAIT_S`` at most, the rest runs on in the background."""
    task = _in_background(_finish(backend, gens))
    with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
        # asyncio.wait neither cancels the task at its timeout nor when this caller is cancelled.
        await asyncio.wait({task}, timeout=FINISH_WAIT_S)
    if not task.done():
        logger.warning(
            "aborting and recording %s takes over %g s; left to finish in the background",
            ", ".join(g.req.request_id for g in gens),
            FINISH_WAIT_S,
        )


async def _cancel_and_wait(tasks: list[asyncio.Future[Any]]) -> None:
    """Cancel the tasks and let them unwind (their backend iterators stop) before anyone closes them."""
    for t in tasks:
        if not t.done():
            t.cancel()
    with anyio.CancelScope(shield=True):
        await asyncio.wait(tasks)


async def _wait_disconnect(request: HTTPRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: HTTPRequest, aw: Awaitable[T]) -> T:
    """Await ``aw`` unless the client disconnects first; then cancel it and raise :class:`ClientGone`."""
    work = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _cancel_and_wait([work, watcher])
        raise
    if work in done and not work.cancelled() and work.exception() is None:
        # The common case, on the time to first token: the watcher only waits on the client, so it is cancelled
        # and left to unwind on its own; waiting for that would cost the response a turn or two of the loop.
        watcher.cancel()
        return work.result()
    await _cancel_and_wait([work, watcher])
    if work in done:
        return work.result()  # raises the work's own error
    raise ClientGone()


async def each(gens: list[Generation], step: Callable[[Generation], Awaitable[None]]) -> None:
    """Run ``step`` (``Generation.prime``, ``Generation.collect``) on every generation at once; the first
    failure cancels the others."""
    if len(gens) == 1:  # no task of its own: one turn of the event loop less before the first token goes out
        await step(gens[0])
        return
    tasks = [asyncio.ensure_future(step(g)) for g in gens]
    try:
        await asyncio.gather(*tasks)
    finally:
        await _cancel_and_wait(tasks)


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Event]]:
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
        await _cancel_and_wait(tasks)


class StreamResponse(StreamingResponse):
    """SSE response that aborts and records its requests however the stream ends, and that ends
    ``STREAM_GRACE_S`` after its deadline at the latest (the content reports the timeout itself; this bound is
    for a client that stopped reading, whose send never returns)."""

    def __init__(
        self,
        content: AsyncIterator[str],
        backend: ServingBackend,
        gens: list[Generation],
        deadline: Deadline | None = None,
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._backend = backend
        self._gens = gens
        self._deadline = deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = math.inf if self._deadline is None else self._deadline.remaining() + STREAM_GRACE_S
        try:
            with anyio.move_on_after(limit) as cut:
                await super().__call__(scope, receive, send)
            if cut.cancelled_caught:
                logger.warning(
                    "stream %s cut off %g s after its deadline: the client is not reading it",
                    self._gens[0].req.request_id,
                    STREAM_GRACE_S,
                )
        finally:
            await finish_shielded(self._backend, self._gens)
