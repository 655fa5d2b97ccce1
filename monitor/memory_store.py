"""MemoryStore: the embedded default monitor store (dicts behind a lock, expiry by the store's clock)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from monitor.config import MonitorConfig
from monitor.store import Clock, HashOp, MonitorStore


class MemoryStore(MonitorStore):
    """The embedded default: dicts behind a lock, expiry by the store's clock."""

    _PRUNE_EVERY_S = 10.0

    def __init__(self, config: MonitorConfig, clock: Clock = time.time) -> None:
        super().__init__(config, clock)
        self._lock = threading.Lock()
        self._hashes: dict[str, dict[str, float]] = {}
        self._expiry: dict[str, float] = {}
        self._workers: dict[str, str] = {}
        self._requests: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._docs: dict[str, str] = {}
        self._next_prune = 0.0

    def _prune(self, now: float) -> None:
        if now < self._next_prune:
            return
        self._next_prune = now + self._PRUNE_EVERY_S
        for key in [k for k, deadline in self._expiry.items() if deadline <= now]:
            self._hashes.pop(key, None)
            del self._expiry[key]
        for rid in [r for r, (_, deadline) in self._requests.items() if deadline <= now]:
            del self._requests[rid]

    def _apply(self, ops: list[HashOp]) -> None:
        now = self.clock()
        with self._lock:
            self._prune(now)
            for op in ops:
                if op.key in self._expiry and self._expiry[op.key] <= now:
                    self._hashes.pop(op.key, None)
                h = self._hashes.setdefault(op.key, {})
                for name, value in op.incr.items():
                    h[name] = h.get(name, 0.0) + value
                h.update(op.set)
                if op.ttl_s is not None:
                    self._expiry[op.key] = now + op.ttl_s

    def _read(self, keys: list[str]) -> list[dict[str, float]]:
        now = self.clock()
        with self._lock:
            return [
                dict(self._hashes.get(k, {})) if self._expiry.get(k, float("inf")) > now else {} for k in keys
            ]

    def _put_worker(self, worker_id: str, doc: str) -> None:
        with self._lock:
            self._workers[worker_id] = doc

    def _get_workers(self) -> dict[str, str]:
        with self._lock:
            return dict(self._workers)

    def _del_worker(self, worker_id: str) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)

    def _put_request(self, request_id: str, doc: str, ttl_s: float) -> bool:
        now = self.clock()
        with self._lock:
            self._prune(now)
            old = self._requests.get(request_id)
            if old is not None and old[1] > now:
                return False
            self._requests[request_id] = (doc, now + ttl_s)
            self._requests.move_to_end(request_id)
            while len(self._requests) > self.config.max_requests:
                self._requests.popitem(last=False)
            return True

    def _get_request(self, request_id: str) -> str | None:
        with self._lock:
            found = self._requests.get(request_id)
        return found[0] if found is not None and found[1] > self.clock() else None

    def _recent_requests(self, limit: int) -> list[str]:
        now = self.clock()
        out: list[str] = []
        with self._lock:
            for doc, deadline in reversed(self._requests.values()):
                if len(out) >= limit:
                    break
                if deadline > now:
                    out.append(doc)
        return out

    def _put_doc(self, name: str, doc: str) -> None:
        with self._lock:
            self._docs[name] = doc

    def _get_doc(self, name: str) -> str | None:
        with self._lock:
            return self._docs.get(name)

    def documents(self) -> dict[str, str]:
        with self._lock:
            return dict(self._docs)

    def sizes(self) -> dict[str, int]:
        """How many entries each structure holds (for the bounded-memory tests)."""
        with self._lock:
            return {
                "hashes": len(self._hashes),
                "fields": sum(len(h) for h in self._hashes.values()),
                "requests": len(self._requests),
                "workers": len(self._workers),
            }
