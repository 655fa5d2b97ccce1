"""A request's deadline: the moment past which the gateway stops waiting for it, answers 408 (or ends its stream
with a timeout error) and aborts it everywhere.

Every request has one: the server's ``request_timeout_s`` (``GatewaySettings``), or less when the client asks for
less with the ``x-request-timeout-ms`` header (milliseconds, as the ``x-slo-*-ms`` headers; a value above the
server's limit is capped to it). It runs from the moment the request's headers are read, so reading the body,
tokenizing, queueing, prefill and decode all count.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from gateway.backend import TimedOut
from gateway.protocol import APIError

T = TypeVar("T")

HEADER = "x-request-timeout-ms"


@dataclass(frozen=True)
class Deadline:
    timeout_s: float
    # What set the timeout, as the 408 names it (the header, or the server's setting).
    source: str
    # time.monotonic() at which it passes.
    at: float

    @classmethod
    def after(cls, timeout_s: float, source: str) -> Deadline:
        return cls(timeout_s, source, time.monotonic() + timeout_s)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def error(self) -> TimedOut:
        return TimedOut(
            f"the request timed out: it did not complete within {self.timeout_s:g} s ({self.source}); "
            "it was aborted"
        )

    async def bound(self, aw: Awaitable[T]) -> T:
        """``await aw``, unless the deadline passes first: then ``aw`` is cancelled and :class:`TimedOut` raised.

        What is ready without waiting is still returned after the deadline; any wait past it is not allowed.
        """
        scope = asyncio.timeout(self.remaining())
        try:
            async with scope:
                return await aw
        except TimeoutError:
            if scope.expired():
                raise self.error() from None
            raise  # a timeout of the awaited call's own


def request_deadline(headers: Mapping[str, str], limit_s: float) -> Deadline:
    """The deadline of a request that arrives now: ``x-request-timeout-ms`` capped to ``limit_s``, or ``limit_s``.

    A header that is not a positive number of milliseconds is a 400 naming it.
    """
    raw = headers.get(HEADER)
    if raw is None:
        return Deadline.after(limit_s, "the server's request timeout")
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms) or ms <= 0:
        raise APIError(
            400, f"{HEADER} header must be a positive number of milliseconds, got {raw!r}", param=HEADER
        )
    if ms / 1e3 >= limit_s:
        return Deadline.after(limit_s, f"{HEADER} capped to the server's request timeout")
    return Deadline.after(ms / 1e3, f"{HEADER}: {raw.strip()}")
