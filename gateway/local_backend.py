"""One in-process engine behind the gateway, without Ray: for exercising the HTTP layer on a real model
from Python (``create_app(LocalEngineBackend(config))``: tests, benchmarks). No ``serve`` mode builds it.

A background thread owns the engine: it takes new requests and aborts from the event loop, runs
engine steps, and hands each step's outputs back to the waiting coroutines with one
``call_soon_threadsafe`` per event loop per step (not one per token). An embedded monitor keeps
the worker stats and request records behind ``/metrics`` and the dashboard.

The monitor may be built on the Redis store (``Monitor(MonitorConfig.for_url(redis_url))``): then
several gateways share one view and a restarted gateway reads its history back. Each gateway
sharing a store then needs its own ``worker_id``, or their heartbeats overwrite each other.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestRejected
from engine.request import FinishReason, Request, RequestOutput, mark_first_tokens
from gateway.backend import BackendError, ModelInfo, Overloaded, Rejected, ServingBackend, Unavailable
from monitor import Monitor, WorkerStats, stages
from monitor.records import RequestRecord

logger = logging.getLogger(__name__)

T = TypeVar("T")

WORKER_ID = "local-0"


class EngineFailed(BackendError):
    status = 500
    code = "engine_error"


class LocalEngineBackend(ServingBackend):
    """``max_queued``: requests admitted beyond the engine's ``max_num_seqs`` before new ones get 429.

    ``monitor``: where stats and request records go; a monitor passed in stays open after
    ``close()`` (its owner closes it), one made here is closed with the backend.
    ``worker_id``: the engine's name in the monitor's worker table.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        engine: LLMEngine | None = None,
        model_name: str | None = None,
        max_queued: int = 256,
        monitor: Monitor | None = None,
        stats_interval_s: float = 1.0,
        worker_id: str = WORKER_ID,
    ) -> None:
        if (config is None) == (engine is None):
            raise ValueError("LocalEngineBackend takes exactly one of config or engine")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
        self.engine = engine if engine is not None else LLMEngine(config)  # type: ignore[arg-type]
        cfg = self.engine.config
        self._info = ModelInfo(
            name=model_name or cfg.model,
            path=str(self.engine.loaded.path),
            max_model_len=cfg.scheduler.max_model_len,
            eos_token_ids=tuple(sorted(self.engine.eos_token_ids)),
        )
        self.max_inflight = cfg.scheduler.max_num_seqs + max_queued
        self._owns_monitor = monitor is None
        self.monitor = monitor if monitor is not None else Monitor()
        self.worker_id = worker_id
        self.stats_interval_s = stats_interval_s
        # Engine state is touched only under this lock (by the thread, or by inspect()).
        self._engine_lock = threading.Lock()
        # Guards the hand-over lists below; never held while the engine steps.
        self._cv = threading.Condition()
        self._to_add: list[Request] = []
        self._to_abort: list[str] = []
        self._busy = False
        self._stopping = False
        # request id -> (event loop, queue) of the coroutine awaiting its outputs.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._last_batch_ms: float | None = None
        self._thread = threading.Thread(target=self._run, name="local-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ ServingBackend

    def model_info(self) -> ModelInfo:
        return self._info

    def max_in_flight(self) -> int:
        return self.max_inflight

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        if self._stopping or not self._thread.is_alive():
            raise Unavailable("the engine is not running")
        if len(self._streams) >= self.max_inflight:
            raise Overloaded(
                f"admission queue full: {len(self._streams)} requests in flight (limit {self.max_inflight})",
                retry_after_s=1.0,
            )
        try:
            self.engine.validate(req)  # reads the config only; safe outside the lock
        except RequestRejected as e:
            raise Rejected(str(e)) from None
        if req.request_id in self._streams:
            raise Rejected(f"duplicate request id {req.request_id!r}")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[req.request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.monitor.record_arrival(req.priority_class.value, req.num_prompt_tokens)
        except Exception:  # a monitor store outage (Redis down) must not fail the request
            logger.exception("could not record the arrival of %s", req.request_id)
        submitted: dict[str, float] | None = {stages.SUBMITTED: time.time()}
        with self._cv:
            self._to_add.append(req)
            self._cv.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine no longer holds it
                    raise item
                if submitted is not None and isinstance(item, RequestOutput):
                    item, submitted = item.marked(submitted), None
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(req.request_id, None)
            if not finished:
                # Synchronous hand-over: safe even while the caller is being cancelled.
                self._request_abort(req.request_id)

    async def abort(self, request_id: str) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            # End its stream now, as the cluster backend does; the engine frees its KV at its next step.
            out = RequestOutput(request_id, [], [], True, FinishReason.ABORT, 0, 0)
            target[0].call_soon_threadsafe(target[1].put_nowait, out)
        self._request_abort(request_id)

    async def health(self) -> dict:
        up = self._thread.is_alive() and not self._stopping
        return {
            "ready": up,
            "workers": [
                {
                    "id": self.worker_id,
                    "role": "colocated",
                    "up": up,
                    # The engine warms up in its constructor, so a running backend is warmed.
                    "warmed": True,
                    "skip_warmup": self.engine.config.skip_warmup,
                }
            ],
        }

    async def metrics_text(self) -> str:
        return self.monitor.metrics_text(self._info.name)

    async def dashboard_data(self, window_s: float) -> dict:
        return self.monitor.dashboard_data(window_s)

    async def record(self, rec: RequestRecord) -> None:
        self.monitor.record_request(rec)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    # ------------------------------------------------------------------ local API

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=30)
        error = Unavailable("the engine was shut down")
        self._deliver_all([(rid, error) for rid in list(self._streams)])
        if self._owns_monitor:
            self.monitor.close()

    def inspect(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` while the engine thread is between steps (tests, diagnostics)."""
        with self._engine_lock:
            return fn(self.engine)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Block until no request is queued, running or being handed over; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._cv:
                pending = self._to_add or self._to_abort or self._busy
            if not pending and not self.inspect(lambda e: e.has_unfinished()):
                return True
            time.sleep(0.01)
        return False

    # ------------------------------------------------------------------ engine thread

    def _request_abort(self, request_id: str) -> None:
        with self._cv:
            self._to_abort.append(request_id)
            self._cv.notify()

    def _run(self) -> None:
        last_report = 0.0
        while True:
            with self._cv:
                while not (self._to_add or self._to_abort or self._busy or self._stopping):
                    if not self._cv.wait(timeout=self.stats_interval_s):
                        break  # idle: still send a heartbeat below
                if self._stopping:
                    break
                adds, self._to_add = self._to_add, []
                aborts, self._to_abort = self._to_abort, []
            failed: list[tuple[str, Any]] = []
            outs: list[RequestOutput] = []
            with self._engine_lock:
                for req in adds:
                    try:
                        self.engine.add_request(req)
                    except (RequestRejected, ValueError) as e:
                        failed.append((req.request_id, Rejected(str(e))))
                for rid in aborts:
                    self.engine.abort(rid)  # None when it already finished: nothing to free
                if self.engine.has_unfinished():
                    start = time.time()
                    t0 = time.perf_counter()
                    try:
                        outs = self.engine.step()
                        outs = mark_first_tokens(
                            outs, {stages.FORWARD_START: start, stages.FORWARD_END: time.time()}
                        )
                    except Exception as e:  # a broken step must not leave clients waiting forever
                        logger.exception("engine step failed; failing every request in flight")
                        failed += self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                    self._last_batch_ms = (time.perf_counter() - t0) * 1e3
                busy = self.engine.has_unfinished()
            with self._cv:
                self._busy = busy
            self._deliver_all([(o.request_id, o) for o in outs] + failed)
            now = time.monotonic()
            if now - last_report >= self.stats_interval_s or not busy:
                last_report = now
                self._report_stats()
        logger.info("local engine thread stopped")

    def _fail_all(self, message: str) -> list[tuple[str, Any]]:
        failed = []
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            failed.append((rid, EngineFailed(message)))
        return failed

    def _deliver_all(self, items: list[tuple[str, Any]]) -> None:
        """One callback per event loop for the whole step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = (
            collections.defaultdict(list)
        )
        for rid, item in items:
            target = self._streams.get(rid)
            if target is not None:
                by_loop[target[0]].append((target[1], item))
        for loop, batch in by_loop.items():
            # A closed loop's requests are gone with it: nothing to deliver.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, batch)

    def _report_stats(self) -> None:
        with self._engine_lock:
            s = self.engine.worker_stats()
        try:
            self.monitor.report_worker(
                WorkerStats(
                    worker_id=self.worker_id,
                    role="colocated",
                    free_memory_bytes=int(s["free_device_memory"]),
                    kv_blocks_total=int(s["kv_blocks_total"]),
                    kv_blocks_used=int(s["kv_blocks_used"]),
                    kv_blocks_free=int(s["kv_blocks_free"]),
                    queue_len=int(s["queue_len"]),
                    running=int(s["running"]),
                    batch_latency_ms=self._last_batch_ms,
                    runtime_compilations=int(s["runtime_compilations"]),
                    warmed=not self.engine.config.skip_warmup,
                    timestamp=time.time(),
                )
            )
        except Exception:  # the monitor is for operators; serving goes on without it
            logger.exception("could not report worker stats")


def _put_all(batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
