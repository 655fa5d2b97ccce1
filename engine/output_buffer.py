"""Per-consumer buffers of engine outputs, drained by long-poll.

A worker appends the outputs of each engine step; each gateway (consumer) collects everything new with one
``drain(consumer, timeout)`` call, so the hot path costs one remote call per step per gateway, not one per
token per request. Thread-safe: the worker's loop thread appends while an actor thread drains.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from engine.request import RequestOutput


class OutputBuffers:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._buffers: dict[str, list[RequestOutput]] = {}

    def put(self, consumer_id: str, outputs: Iterable[RequestOutput]) -> None:
        items = list(outputs)
        if not items:
            return
        with self._cond:
            self._buffers.setdefault(consumer_id, []).extend(items)
            self._cond.notify_all()

    def put_many(self, routed: Iterable[tuple[str, RequestOutput]]) -> None:
        with self._cond:
            any_put = False
            for consumer_id, out in routed:
                self._buffers.setdefault(consumer_id, []).append(out)
                any_put = True
            if any_put:
                self._cond.notify_all()

    def drain(self, consumer_id: str, timeout: float) -> list[RequestOutput]:
        """Everything buffered for ``consumer_id``; waits up to ``timeout`` seconds when nothing is."""
        with self._cond:
            if not self._buffers.get(consumer_id):
                self._cond.wait_for(lambda: bool(self._buffers.get(consumer_id)), timeout=timeout)
            return self._buffers.pop(consumer_id, [])

    def wake(self) -> None:
        """Release every waiting drain (shutdown)."""
        with self._cond:
            self._cond.notify_all()
