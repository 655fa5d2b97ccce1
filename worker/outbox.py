"""Per-consumer buffers of engine outputs, drained by long-poll with acknowledgement.

A worker appends the outputs of each engine step; each gateway (consumer) collects everything new with one
``drain(consumer, timeout, ack)`` call, so the hot path costs one remote call per step per gateway, not one
per token per request. Each answer carries a sequence number that the next call acknowledges; an answer that
was never acknowledged (its caller was cancelled, its reply lost) is sent again with the next one, so no output
is lost when a gateway's poller restarts. Thread-safe: the worker's loop thread appends while actor threads
drain.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.request import RequestOutput


@dataclass
class _Consumer:
    new: list[RequestOutput] = field(default_factory=list)
    unacked: list[RequestOutput] = field(default_factory=list)
    seq: int = 0


class OutputBuffers:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._consumers: dict[str, _Consumer] = {}

    def put(self, consumer_id: str, outputs: Iterable[RequestOutput]) -> None:
        self.put_many((consumer_id, o) for o in outputs)

    def put_many(self, routed: Iterable[tuple[str, RequestOutput]]) -> None:
        with self._cond:
            any_put = False
            for consumer_id, out in routed:
                self._consumers.setdefault(consumer_id, _Consumer()).new.append(out)
                any_put = True
            if any_put:
                self._cond.notify_all()

    def drain(self, consumer_id: str, timeout: float, ack: int = -1) -> tuple[int, list[RequestOutput]]:
        """``(seq, outputs)``: everything for ``consumer_id`` not yet acknowledged, waiting up to ``timeout``
        seconds when there is nothing. ``ack`` is the ``seq`` of the last answer the caller received."""
        with self._cond:
            c = self._consumers.setdefault(consumer_id, _Consumer())
            if ack == c.seq:
                c.unacked = []
            if not c.unacked and not c.new:
                self._cond.wait_for(lambda: bool(c.new), timeout=timeout)
                if ack == c.seq:  # another call may have answered meanwhile
                    c.unacked = []
            c.unacked = c.unacked + c.new
            c.new = []
            c.seq += 1
            return c.seq, list(c.unacked)

    def wake(self) -> None:
        """Release every waiting drain (shutdown)."""
        with self._cond:
            self._cond.notify_all()
