"""Stats reporting shared by every worker actor: the heartbeat to the monitor and the stats record."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from monitor.records import WorkerStats

logger = logging.getLogger(__name__)


class Heartbeat:
    """Pushes a worker's :class:`WorkerStats` to the monitor every ``interval_s`` and, rate-limited, on demand
    (after a batch), so the controller sizes batches from figures at most ``interval_s`` old.

    Fire-and-forget, one report in flight at most: while the monitor has not taken the last one (it is slow or
    hung), newer ones are skipped rather than queued behind it without bound."""

    def __init__(self, monitor, stats_fn: Callable[[], WorkerStats], interval_s: float) -> None:
        self.monitor = monitor
        self.stats_fn = stats_fn
        self.interval_s = interval_s
        self._last = 0.0
        self._in_flight: Future | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.monitor is None:
            return
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._closed.wait(self.interval_s):
            self.push(force=True)

    def push(self, force: bool = False) -> None:
        if self.monitor is None:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval_s / 4:
            return
        in_flight = self._in_flight
        if in_flight is not None and not in_flight.done():
            return
        self._last = now
        try:
            self._in_flight = self.monitor.report_worker.remote(self.stats_fn()).future()
        except Exception as e:  # a monitor restart must not take a worker down
            logger.warning("stats report failed: %s", e)

    def close(self) -> None:
        self._closed.set()


def engine_worker_stats(
    engine, worker_id: str, role: str, warmed: bool, batch_latency_ms: float | None, queue_len: int
) -> WorkerStats:
    s = engine.worker_stats()
    return WorkerStats(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        free_memory_bytes=int(s["free_device_memory"]),
        kv_blocks_total=int(s["kv_blocks_total"]),
        kv_blocks_used=int(s["kv_blocks_used"]),
        kv_blocks_free=int(s["kv_blocks_free"]),
        queue_len=queue_len,
        running=int(s["running"]),
        batch_latency_ms=batch_latency_ms,
        runtime_compilations=int(s["runtime_compilations"]),
        warmed=warmed,
        timestamp=time.time(),
    )
