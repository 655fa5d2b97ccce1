"""A gateway's graceful stop: refuse new requests, let the open ones run for a while, then end the rest.

While draining, ``/v1/*`` answers 503 (OpenAI's error shape, with Retry-After) and ``/health`` answers 503
("draining"), so clients and load balancers go elsewhere, while the requests already admitted run on. When
the drain period is over, each request still open is aborted in the backend (its KV is freed) and ends with
an error: a stream with an error chunk and then ``data: [DONE]``, a JSON request with a 503.

``bucketserve serve`` starts the drain on every gateway replica on SIGTERM or Ctrl-C
(``gateway/drain_signal.py``); the replica reports back when its requests have ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass

from gateway.backend import ServingBackend
from gateway.generation import Generation
from gateway.protocol import APIError

logger = logging.getLogger(__name__)

# Retry-After of the 503s while draining: this server is going away, another replica (or this server restarted)
# can take the request at once.
RETRY_AFTER_S = 1
# How often the drain looks at its open requests (a scan of a dict, only while draining).
_POLL_S = 0.05
# After the period: how long the aborted requests have to end (an abort is one message to the cluster).
_CUT_GRACE_S = 5.0
CUT_MESSAGE = (
    "the server is shutting down: this request did not finish within its drain period and was aborted"
)


@dataclass(frozen=True)
class DrainReport:
    """What one gateway's drain did: requests open when it began, those that ran to their end, those cut."""

    open_at_start: int
    finished: int
    cut: int
    seconds: float


class Drain:
    """The open requests of one gateway app, and whether it still takes new ones."""

    def __init__(self, backend: ServingBackend) -> None:
        self._backend = backend
        self._draining = False
        # Admitted generations by id(), held weakly: a request's objects (and the backend's state for it, which
        # goes when its output iterator is collected) must not outlive its handler because of this table. The
        # ended ones are pruned as it grows.
        self._open: dict[int, weakref.ref[Generation]] = {}
        self._prune_at = 64

    @property
    def draining(self) -> bool:
        return self._draining

    def check(self) -> None:
        """Refuse a new request while draining: a 503 with Retry-After."""
        if self._draining:
            raise APIError(
                503,
                "the server is shutting down and takes no new requests; retry on another replica",
                type="server_error",
                code="shutting_down",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def admit(self, gens: list[Generation]) -> None:
        """Follow these generations until they end (a request that arrived while draining is refused here)."""
        self.check()
        if len(self._open) >= self._prune_at:
            self._prune()
            self._prune_at = max(64, 2 * len(self._open))
        for g in gens:
            self._open[id(g)] = weakref.ref(g)

    def _live(self) -> list[Generation]:
        return [g for ref in self._open.values() if (g := ref()) is not None and not g.ended]

    def _prune(self) -> None:
        self._open = {id(g): weakref.ref(g) for g in self._live()}

    def in_flight(self) -> int:
        return len(self._live())

    def health(self) -> dict:
        return {"ready": False, "draining": True, "in_flight": self.in_flight()}

    async def run(self, timeout_s: float) -> DrainReport:
        """Drain: from now on refuse new requests; return when every open request has ended, cutting those
        still open after ``timeout_s``."""
        t0 = time.monotonic()
        self._draining = True
        at_start = len(self._live())
        cut = 0
        deadline = t0 + timeout_s
        while live := self._live():
            now = time.monotonic()
            if now >= deadline + _CUT_GRACE_S:
                logger.warning("%d request(s) did not end after being aborted", len(live))
                break
            if now >= deadline:
                cut += await self._cut(live)
            await asyncio.sleep(_POLL_S)
        report = DrainReport(at_start, max(0, at_start - cut), cut, time.monotonic() - t0)
        logger.info("drained: %s", report)
        return report

    async def _cut(self, live: list[Generation]) -> int:
        """Abort every open generation not cut yet; each then ends with an error (``Generation.cut``)."""
        fresh = [g for g in live if g.cut is None]
        for g in fresh:
            g.cut = CUT_MESSAGE
        results = await asyncio.gather(
            *(self._backend.abort(g.req.request_id) for g in fresh), return_exceptions=True
        )
        for g, r in zip(fresh, results, strict=True):
            if isinstance(r, BaseException):
                logger.warning("abort of %s at the end of the drain failed: %s", g.req.request_id, r)
        return len(fresh)
