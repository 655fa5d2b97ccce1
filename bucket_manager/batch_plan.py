"""Forming one prefill batch: a pure function of the queue, the warmed shapes, the memory figures and the policy.

:func:`plan_batch` picks a request bucket (the one holding the most urgent online request, or offline work when
the starvation guard says it is due), then takes that bucket's requests in priority order while the batch still

* fits the safe KV blocks of its prefill worker and of its decode worker,
* stays within ``max_num_batched_tokens`` real tokens and the largest warmed prefill batch size, and
* pads onto a warmed prompt shape, and
* keeps to one range of lengths once past a short batch's tokens (``PriorityPolicy.joins``).

With ``PriorityPolicy.late_last``, requests that can no longer meet their TTFT come after those that still can:
online requests on time, then offline ones on time, then online ones late, then offline ones late, each group in
its class's order (the starvation guards still come first).

It stops at the first request that does not fit rather than skipping it, so the head of the order is never
overtaken and cannot starve. If the first request alone does not fit the memory, there is no plan (wait for
memory). If it alone is above every warmed shape, it is planned alone with ``shape=None``: the runner runs it
unpadded and counts a compilation. The plan names the requests; the caller removes them from the queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain

from bucket_manager.memory_budget import MemoryBudget
from bucket_manager.priority import PriorityPolicy
from bucket_manager.request import PriorityClass, RequestSummary
from bucket_manager.request_buckets import Key, RequestBuckets
from bucket_manager.shape_buckets import Bucket, ShapeBuckets


@dataclass(frozen=True)
class BatchPlan:
    request_ids: tuple[str, ...]
    priority_class: PriorityClass  # the class that chose the bucket
    request_bucket: int
    shape: Bucket | None  # the warmed prompt shape; None: above every shape, runs unpadded
    real_tokens: int
    padded_tokens: int  # shape tokens (batch x query) minus real tokens; 0 when unpadded
    prefill_blocks: int
    decode_blocks: int
    by_guard: bool = (
        False  # chosen by a starvation guard (offline aging or share, online sjf aging), not the order
    )

    @property
    def padding_ratio(self) -> float:
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0


def _choose_bucket(
    queue: RequestBuckets, policy: PriorityPolicy, now: float, online_streak: int, pace: float
) -> tuple[PriorityClass, int, RequestSummary | None, bool] | None:
    """(class, bucket index, request to put first, chosen by the guard) or None when nothing is queued."""
    oldest_offline = queue.oldest(PriorityClass.OFFLINE)
    due = policy.offline_is_due(
        None if oldest_offline is None else oldest_offline.arrival, now, online_streak
    )
    online: tuple[int, bool] | None = None
    if not due:
        oldest_online = queue.oldest(PriorityClass.ONLINE)
        if oldest_online is not None and policy.online_is_overdue(oldest_online.arrival, now):
            index = queue.bucket_index(oldest_online.prompt_len)
            return PriorityClass.ONLINE, index, oldest_online, True
        online = _most_urgent(queue, PriorityClass.ONLINE, policy, now, pace)
        if online is not None and not online[1]:
            return PriorityClass.ONLINE, online[0], None, False
        # Every queued online request is late (or none is queued): offline work that can still meet its TTFT goes
        # first.
    if oldest_offline is None:
        return None if online is None else (PriorityClass.ONLINE, online[0], None, False)
    if due and policy.starvation_guard == "aging":
        return PriorityClass.OFFLINE, queue.bucket_index(oldest_offline.prompt_len), oldest_offline, True
    offline = _most_urgent(queue, PriorityClass.OFFLINE, policy, now, pace)
    assert offline is not None  # an offline request exists
    if online is not None and offline[1]:
        # Nothing queued can still meet its TTFT: online work first, as ever.
        return PriorityClass.ONLINE, online[0], None, False
    return PriorityClass.OFFLINE, offline[0], None, due


def _most_urgent(
    queue: RequestBuckets, cls: PriorityClass, policy: PriorityPolicy, now: float, pace: float
) -> tuple[int, bool] | None:
    """The bucket whose first request (by lateness, then the class's order) comes first over all buckets, and
    whether that request is late."""
    best: tuple[tuple[bool, Key], int] | None = None
    for i in range(queue.num_buckets):
        head = queue.head(i, cls)
        if head is None:
            continue
        rank = (policy.is_late(head[1], now, pace), head[0])
        if rank[0]:
            # The head is late: the bucket competes with its first on-time request, if it has one (under arrival
            # order the late ones are mostly the oldest, so the walk is short).
            on_time = next((r for r in queue.ordered(i, cls) if not policy.is_late(r, now, pace)), None)
            if on_time is not None:
                rank = (False, queue.key_of(on_time.request_id))
        if best is None or rank < best[0]:
            best = (rank, i)
    return None if best is None else (best[1], best[0][0])


def _candidates(
    queue: RequestBuckets,
    index: int,
    cls: PriorityClass,
    first: RequestSummary | None,
    policy: PriorityPolicy,
    now: float,
    pace: float,
) -> Iterator[RequestSummary]:
    own: Iterable[RequestSummary] = queue.ordered(index, cls)
    if policy.late_last:
        # On-time requests first, then the late ones, each in the class's order (two lazy walks of the heap).
        own = chain(
            (r for r in queue.ordered(index, cls) if not policy.is_late(r, now, pace)),
            (r for r in queue.ordered(index, cls) if policy.is_late(r, now, pace)),
        )
    if first is not None:
        own = chain([first], (r for r in own if r.request_id != first.request_id))
    if not policy.fill_with_other_class:
        return iter(own)
    other = PriorityClass.OFFLINE if cls is PriorityClass.ONLINE else PriorityClass.ONLINE
    return chain(own, queue.ordered(index, other))


def first_request(
    queue: RequestBuckets,
    policy: PriorityPolicy,
    now: float,
    online_streak: int = 0,
    seconds_per_token: float = 0.0,
) -> RequestSummary | None:
    """The request the next :func:`plan_batch` puts first (None when the queue is empty)."""
    choice = _choose_bucket(queue, policy, now, online_streak, seconds_per_token)
    if choice is None:
        return None
    cls, index, first, _ = choice
    return (
        first
        if first is not None
        else next(_candidates(queue, index, cls, None, policy, now, seconds_per_token))
    )


def plan_batch(
    queue: RequestBuckets,
    shapes: ShapeBuckets,
    budget: MemoryBudget,
    policy: PriorityPolicy,
    now: float,
    online_streak: int = 0,
    seconds_per_token: float = 0.0,
) -> BatchPlan | None:
    """The next prefill batch, or None when the queue is empty or its first request does not fit the memory.

    ``now`` is on the clock of the requests' ``arrival``; ``online_streak`` counts online batches since the
    last offline one (used by the ``share`` guard); ``seconds_per_token`` is the prefill workers' pace
    (:class:`~bucket_manager.prefill_pace.PrefillPace`), which tells the requests that can still meet their TTFT.
    """
    choice = _choose_bucket(queue, policy, now, online_streak, seconds_per_token)
    if choice is None:
        return None
    cls, index, first, by_guard = choice
    largest = shapes.max_prompt_batch_size
    ids: list[str] = []
    tokens = longest = prefill_blocks = decode_blocks = 0
    shortest = 0
    shape: Bucket | None = None
    for request in _candidates(queue, index, cls, first, policy, now, seconds_per_token):
        count = len(ids) + 1
        new_tokens = tokens + request.prompt_len
        new_prefill = prefill_blocks + budget.prefill_need(request.prompt_len)
        new_decode = decode_blocks + budget.decode_need(request.prompt_len, request.max_tokens)
        if new_prefill > budget.prefill_blocks or new_decode > budget.decode_blocks:
            break
        if ids and not policy.joins(tokens, shortest, longest, request.prompt_len):
            break
        new_longest = max(longest, request.prompt_len)
        new_shape = shapes.find_prompt(count, new_longest, 0)
        fits = count <= largest and new_tokens <= budget.max_num_batched_tokens and new_shape is not None
        if not fits:
            if ids:
                break
            # Alone and above every warmed shape: it can only run unpadded.
            return BatchPlan(
                (request.request_id,), cls, index, None, new_tokens, 0, new_prefill, new_decode, by_guard
            )
        ids.append(request.request_id)
        shortest = min(shortest, request.prompt_len) if shortest else request.prompt_len
        tokens, longest, prefill_blocks, decode_blocks, shape = (
            new_tokens,
            new_longest,
            new_prefill,
            new_decode,
            new_shape,
        )
    if not ids or shape is None:
        return None
    padded = shape[0] * shape[1] - tokens
    return BatchPlan(tuple(ids), cls, index, shape, tokens, padded, prefill_blocks, decode_blocks, by_guard)
