"""FallbackStore: a shared store (Redis) that the monitor keeps answering through while it is down.

The cluster reports to the monitor without waiting on it, and the controller plans from its figures, so a
store outage (Redis killed, restarted, hung or cut off) must cost figures, never service. While the shared
store is unreachable the monitor answers from memory:

- worker heartbeats and the bucket state are always mirrored in memory (one small entry each), so the
  controller's figures (free KV blocks, workers up) stay current through an outage;
- counters, series and request records written during the outage go to memory only, so ``/metrics`` and the
  dashboard show degraded figures: this monitor's own since the outage began, not the shared history. They
  are NOT copied to the shared store when it returns: history written during an outage is lost to it (and a
  Redis restarted without persistence has lost what it held before, too);
- a background thread tries the store again every ``reconnect_s``; once it answers, the worker table and the
  bucket state are written back to it, and reads and writes go to it again.

Only the calls that meet the outage first pay the client's timeouts (see ``MonitorConfig.redis_*``); later
ones go straight to memory. One warning is logged when an outage begins and one when it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from monitor.memory_store import MemoryStore
from monitor.store import HashOp, MonitorStore

logger = logging.getLogger(__name__)

T = TypeVar("T")


class FallbackStore(MonitorStore):
    """``primary`` answers while it can; its ``outage_errors`` switch every call to memory until it is back."""

    def __init__(self, primary: MonitorStore, reconnect_s: float) -> None:
        super().__init__(primary.config, primary.clock)
        self.primary = primary
        self.memory = MemoryStore(primary.config, primary.clock)
        self._errors = primary.outage_errors
        self._reconnect_s = reconnect_s
        self._lock = threading.Lock()
        self._down_since: float | None = None  # time.monotonic() when this outage was noticed
        self._error = ""
        self._closed = threading.Event()

    @property
    def up(self) -> bool:
        return self._down_since is None

    def outage(self) -> str | None:
        since = self._down_since
        if since is None:
            return None
        return (
            f"monitor store unreachable for {time.monotonic() - since:.1f} s ({self._error}); "
            "answering from memory"
        )

    def ping(self) -> None:
        self.primary.ping()

    def close(self) -> None:
        self._closed.set()  # the probe thread, if any, ends at its next wake-up
        self.primary.close()
        self.memory.close()

    # ------------------------------------------------------------ outage handling

    def _call(self, on_primary: Callable[[], T], on_memory: Callable[[], T]) -> T:
        if self._down_since is None:
            try:
                return on_primary()
            except self._errors as e:
                self._lost(e)
        return on_memory()

    def _lost(self, error: BaseException) -> None:
        with self._lock:
            if self._down_since is not None or self._closed.is_set():
                return
            self._down_since = time.monotonic()
            self._error = f"{type(error).__name__}: {error}"
        logger.warning(
            "monitor store unreachable (%s): answering from memory and trying it again every %g s; "
            "figures written meanwhile are kept in memory only",
            self._error,
            self._reconnect_s,
        )
        threading.Thread(target=self._probe, name="monitor-store-probe", daemon=True).start()

    def _probe(self) -> None:
        while not self._closed.wait(self._reconnect_s):
            try:
                self.primary.ping()
                self._restore()
            except self._errors as e:
                self._error = f"{type(e).__name__}: {e}"
                continue
            with self._lock:
                since, self._down_since = self._down_since, None
            down_for = time.monotonic() - since if since is not None else 0.0
            logger.warning(
                "monitor store reachable again after %.1f s; figures written during the outage were not kept",
                down_for,
            )
            return

    def _restore(self) -> None:
        """Write the current worker table and bucket state back, so readers of the shared store see the cluster
        at once rather than after the next heartbeats."""
        for worker_id, doc in self.memory._get_workers().items():
            self.primary._put_worker(worker_id, doc)
        for name, doc in self.memory.documents().items():
            self.primary._put_doc(name, doc)

    # ------------------------------------------------------------ primitives

    def _apply(self, ops: list[HashOp]) -> None:
        self._call(lambda: self.primary._apply(ops), lambda: self.memory._apply(ops))

    def _read(self, keys: list[str]) -> list[dict[str, float]]:
        return self._call(lambda: self.primary._read(keys), lambda: self.memory._read(keys))

    def _put_worker(self, worker_id: str, doc: str) -> None:
        self.memory._put_worker(worker_id, doc)  # the mirror the controller's figures come from in an outage
        self._call(lambda: self.primary._put_worker(worker_id, doc), lambda: None)

    def _get_workers(self) -> dict[str, str]:
        return self._call(self.primary._get_workers, self.memory._get_workers)

    def _del_worker(self, worker_id: str) -> None:
        self.memory._del_worker(worker_id)
        self._call(lambda: self.primary._del_worker(worker_id), lambda: None)

    def _put_request(self, request_id: str, doc: str, ttl_s: float) -> bool:
        return self._call(
            lambda: self.primary._put_request(request_id, doc, ttl_s),
            lambda: self.memory._put_request(request_id, doc, ttl_s),
        )

    def _get_request(self, request_id: str) -> str | None:
        return self._call(
            lambda: self.primary._get_request(request_id), lambda: self.memory._get_request(request_id)
        )

    def _recent_requests(self, limit: int) -> list[str]:
        return self._call(
            lambda: self.primary._recent_requests(limit), lambda: self.memory._recent_requests(limit)
        )

    def _put_doc(self, name: str, doc: str) -> None:
        self.memory._put_doc(name, doc)
        self._call(lambda: self.primary._put_doc(name, doc), lambda: None)

    def _get_doc(self, name: str) -> str | None:
        return self._call(lambda: self.primary._get_doc(name), lambda: self.memory._get_doc(name))
