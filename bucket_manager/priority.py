"""Priority policies: the order of requests inside a class, and how offline work is kept from starving.

Online requests come first: the batch is built from the request bucket holding the most urgent online
request (earliest arrival by default, earliest TTFT deadline, or shortest prompt first). Shortest first keeps
short prompts from queueing behind long prefills, which raises TTFT attainment on mixed lengths; its guard
serves the oldest online request first once it has waited ``max_online_wait_s``, so long prompts still run. A
request that can no longer meet its TTFT deadline goes after those that still can, of either class (``late_last``;
the same guard keeps a late online request from starving). Offline requests are ordered shortest job first (most
requests per second) or longest job first (most tokens per second). Because on-time online work always wins,
offline work needs a guard: ``aging`` serves the oldest offline request first once it has waited
``max_offline_wait_s``; ``share`` gives offline work one batch after every ``online_batches_per_offline``
online batches while both are queued. The integer ``priority`` of a request (smaller first) comes before all
of these inside its class, except lateness: a request that can no longer meet its TTFT goes after the on-time
ones whatever its priority (its SLO is lost either way; theirs is not). Past ``short_batch_tokens`` a batch keeps
to prompts within 2x of each other (:meth:`PriorityPolicy.joins`), so no prompt waits for the prefill of one much
longer than itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bucket_manager.request import PriorityClass, RequestSummary

ONLINE_ORDERS = ("arrival", "deadline", "sjf")
OFFLINE_ORDERS = ("sjf", "ljf")
GUARDS = ("aging", "share", "none")

Key = tuple[float, ...]


@dataclass(frozen=True)
class PriorityPolicy:
    online_order: str = "arrival"
    offline_order: str = "sjf"
    starvation_guard: str = "aging"
    max_offline_wait_s: float = 30.0
    # online_order "sjf", or late_last: an online request that has waited this long goes first whatever its length
    # or lateness, so neither order can starve it.
    max_online_wait_s: float = 10.0
    # A request that can no longer meet its TTFT deadline (past it, or its prompt's prefill alone, at the prefill
    # workers' measured pace, would end after it) goes after every request that still can, online or offline: its
    # SLO is lost whenever it runs, and running it first spends the prefill time that makes the requests behind it
    # late too (a burst's backlog, or a prompt too long for the budget, would otherwise make the arrivals after it
    # miss). Online before offline still holds among the on-time requests and among the late ones.
    late_last: bool = True
    online_batches_per_offline: int = 4
    # Fill room left in a batch with the other class's requests from the same bucket: same padded shape,
    # so they ride along almost for free.
    fill_with_other_class: bool = True
    # A batch grows past this many prompt tokens only with prompts within 2x of its shortest and longest: a long
    # prompt does not join a batch of short ones (their first tokens would all wait for its prefill), nor a short one
    # a long one's batch (it may run beside it on a lending decode worker instead); each runs among its own lengths.
    # 0: batches grow to the token budget whatever the lengths (the FCFS baseline).
    short_batch_tokens: int = 512

    def __post_init__(self) -> None:
        if self.online_order not in ONLINE_ORDERS:
            raise ValueError(f"online_order must be one of {ONLINE_ORDERS}, got {self.online_order!r}")
        if self.offline_order not in OFFLINE_ORDERS:
            raise ValueError(f"offline_order must be one of {OFFLINE_ORDERS}, got {self.offline_order!r}")
        if self.starvation_guard not in GUARDS:
            raise ValueError(f"starvation_guard must be one of {GUARDS}, got {self.starvation_guard!r}")
        for name in ("max_offline_wait_s", "max_online_wait_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if (
            not isinstance(self.short_batch_tokens, int)
            or isinstance(self.short_batch_tokens, bool)
            or self.short_batch_tokens < 0
        ):
            raise ValueError(f"short_batch_tokens must be an int >= 0, got {self.short_batch_tokens!r}")
        if not isinstance(self.late_last, bool):
            raise ValueError(f"late_last must be a bool, got {self.late_last!r}")
        if not isinstance(self.online_batches_per_offline, int) or self.online_batches_per_offline < 1:
            raise ValueError(
                f"online_batches_per_offline must be an int >= 1, got {self.online_batches_per_offline!r}"
            )

    def key(self, request: RequestSummary) -> Key:
        """Sort key inside the request's class: smaller is served first. Arrival breaks the remaining ties."""
        if request.priority_class is PriorityClass.ONLINE:
            if self.online_order == "deadline":
                return (request.priority, request.ttft_deadline, request.arrival)
            if self.online_order == "sjf":
                return (request.priority, request.prompt_len, request.arrival)
            return (request.priority, request.arrival)
        length = request.prompt_len if self.offline_order == "sjf" else -request.prompt_len
        return (request.priority, length, request.arrival)

    def joins(self, batch_tokens: int, shortest: int, longest: int, prompt_len: int) -> bool:
        """Whether a prompt of ``prompt_len`` tokens may join a batch of ``batch_tokens`` prompt tokens whose prompts
        are ``shortest`` to ``longest`` long, by their lengths alone."""
        if not self.short_batch_tokens or batch_tokens + prompt_len <= self.short_batch_tokens:
            return True
        return max(longest, prompt_len) <= 2 * min(shortest, prompt_len)

    def is_late(self, request: RequestSummary, now: float, seconds_per_token: float = 0.0) -> bool:
        """Whether ``request`` goes after the on-time requests (``late_last``): its first token, its prompt
        prefilled from ``now`` at ``seconds_per_token``, would come after its TTFT deadline (never without one)."""
        return self.late_last and now + request.prompt_len * seconds_per_token > request.ttft_deadline

    def online_is_overdue(self, oldest_online_arrival: float | None, now: float) -> bool:
        """Shortest first or late last: whether the oldest online request has waited long enough to go first."""
        if (self.online_order != "sjf" and not self.late_last) or oldest_online_arrival is None:
            return False
        return now - oldest_online_arrival >= self.max_online_wait_s

    def offline_is_due(self, oldest_offline_arrival: float | None, now: float, online_streak: int) -> bool:
        """Whether offline work goes before queued online work now. ``online_streak``: online batches
        formed since the last offline one."""
        if oldest_offline_arrival is None:
            return False
        if self.starvation_guard == "aging":
            return now - oldest_offline_arrival >= self.max_offline_wait_s
        if self.starvation_guard == "share":
            return online_streak >= self.online_batches_per_offline
        return False
