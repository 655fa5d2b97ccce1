"""Per-consumer buffers of engine outputs, drained by long-poll with acknowledgement.

A worker appends the outputs of each engine step; each gateway (consumer) collects everything new with one
``drain(consumer, timeout, ack)`` call, so the hot path costs one remote call per step per gateway, not one
per token per request. Each answer carries a sequence number that the next call acknowledges; an answer that
was never acknowledged (its caller was cancelled, its reply lost) is sent again with the next one, so no output
is lost when a gateway's poller restarts. Thread-safe: the worker's loop thread appends while actor threads
drain.

A consumer on the worker's node may also attach a socket (``worker/output_socket.py``): its outputs are then
written there as they are put, and reach ``drain`` only when a write cannot complete (the socket is then closed).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.request import RequestOutput
from worker.output_socket import encode_frame

logger = logging.getLogger(__name__)


@dataclass
class _Consumer:
    new: list[RequestOutput] = field(default_factory=list)
    unacked: list[RequestOutput] = field(default_factory=list)
    seq: int = 0
    last_drain: float = field(default_factory=time.monotonic)
    parked: int = 0  # drain calls waiting for outputs now
    sink: socket.socket | None = None  # same-node gateway: outputs are written here as they are put


# A gateway drains every worker without pause (each call waits at most a second or so); one silent for this long
# has gone away (crashed, redeployed, scaled down), and its buffer would otherwise grow for as long as the
# worker lives.
CONSUMER_TTL_S = 120.0


class OutputBuffers:
    def __init__(self, consumer_ttl_s: float = CONSUMER_TTL_S) -> None:
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # outputs arrived (drains wait on it)
        self._taken = threading.Condition(lock)  # a drain took outputs (a hand-over waits on it)
        self._consumers: dict[str, _Consumer] = {}
        self._ttl_s = consumer_ttl_s
        # Outputs that left by each way, for the worker's stats (an operator sees which way the tokens go).
        self.sent_by_socket = 0
        self.sent_by_drain = 0
        self._swept = time.monotonic()

    def put(self, consumer_id: str, outputs: Iterable[RequestOutput]) -> None:
        self.put_many((consumer_id, o) for o in outputs)

    def put_many(self, routed: Iterable[tuple[str, RequestOutput]], hand_over_s: float = 0.0) -> None:
        """Add outputs for their consumers. ``hand_over_s`` > 0: then wait, at most that long, until the drain
        calls already waiting for these outputs have taken them. A producer that shares its cores (and Python's
        lock) with the drain calls would otherwise go on with its next work while the outputs wait for a turn."""
        with self._cond:
            got: dict[str, _Consumer] = {}
            pushed: dict[str, list[RequestOutput]] = {}
            for consumer_id, out in routed:
                c = got[consumer_id] = self._consumers.setdefault(consumer_id, _Consumer())
                if c.sink is not None:
                    pushed.setdefault(consumer_id, []).append(out)
                else:
                    c.new.append(out)
            for consumer_id, outs in pushed.items():
                self._push(consumer_id, got[consumer_id], outs)
            if any(c.new for c in got.values()):
                self._cond.notify_all()
            self._drop_gone()
            waiting = [c for c in got.values() if c.parked]
            if hand_over_s > 0 and waiting:
                self._taken.wait_for(lambda: not any(c.new for c in waiting), timeout=hand_over_s)

    def attach(self, consumer_id: str, sink: socket.socket) -> None:
        """Write ``consumer_id``'s outputs to ``sink`` (a non-blocking connected socket) from now on; one attached
        before is closed. Outputs already waiting stay for the consumer's next drain."""
        with self._cond:
            c = self._consumers.setdefault(consumer_id, _Consumer())
            if c.sink is not None:
                c.sink.close()
            c.sink = sink
        logger.info("consumer %s attached its output socket", consumer_id)

    def _push(self, consumer_id: str, c: _Consumer, outs: list[RequestOutput]) -> None:
        """One frame of ``outs`` to the consumer's socket (caller holds the lock). A write that would block or
        fails closes the socket: what it did not carry whole goes to the drain path, and the gateway drops the
        partial frame it reads before the end of the stream."""
        assert c.sink is not None
        frame = encode_frame(outs)
        try:
            sent = c.sink.send(frame)
        except OSError as e:  # BlockingIOError (full buffer), BrokenPipeError (the gateway went away), ...
            why = f"{type(e).__name__}: {e}"
            sent = 0
        else:
            if sent == len(frame):
                self.sent_by_socket += len(outs)
                return
            why = f"buffer full after {sent} of {len(frame)} bytes"
        logger.warning("output socket of consumer %s closed (%s); its outputs go by drain", consumer_id, why)
        c.sink.close()
        c.sink = None
        c.new.extend(outs)

    def _drop_gone(self) -> None:
        """Forget the consumers that stopped draining (caller holds the lock); a sweep at most every few seconds."""
        now = time.monotonic()
        if now - self._swept < min(5.0, self._ttl_s):
            return
        self._swept = now
        for cid in [c for c, buf in self._consumers.items() if now - buf.last_drain > self._ttl_s]:
            dropped = self._consumers.pop(cid)
            if dropped.sink is not None:
                dropped.sink.close()
            logger.warning(
                "consumer %s has not drained for %.0f s: gone; dropping its %d output(s)",
                cid,
                now - dropped.last_drain,
                len(dropped.new) + len(dropped.unacked),
            )

    def parked(self, consumer_id: str) -> int:
        """Drain calls of ``consumer_id`` waiting for outputs now."""
        with self._cond:
            c = self._consumers.get(consumer_id)
            return c.parked if c is not None else 0

    def consumers(self) -> list[str]:
        with self._cond:
            return list(self._consumers)

    def drain(self, consumer_id: str, timeout: float, ack: int = -1) -> tuple[int, list[RequestOutput]]:
        """``(seq, outputs)``: everything for ``consumer_id`` not yet acknowledged, waiting up to ``timeout``
        seconds when there is nothing. ``ack`` is the ``seq`` of the last answer the caller received."""
        with self._cond:
            c = self._consumers.setdefault(consumer_id, _Consumer())
            c.last_drain = time.monotonic()
            if ack == c.seq:
                c.unacked = []
            if not c.unacked and not c.new:
                c.parked += 1
                try:
                    self._cond.wait_for(lambda: bool(c.new), timeout=timeout)
                finally:
                    c.parked -= 1
                if ack == c.seq:  # another call may have answered meanwhile
                    c.unacked = []
            if c.new:
                self._taken.notify_all()
                self.sent_by_drain += len(c.new)
            c.unacked = c.unacked + c.new
            c.new = []
            c.seq += 1
            c.last_drain = time.monotonic()
            return c.seq, list(c.unacked)

    def wake(self) -> None:
        """Release every waiting drain (shutdown)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Close every attached socket (shutdown)."""
        with self._cond:
            for c in self._consumers.values():
                if c.sink is not None:
                    c.sink.close()
                    c.sink = None
