"""Request buckets (BucketServe Algorithm 1): queued requests grouped by prompt length, split and merged with load.

The queue starts as one bucket ``[0, L_max]``. A request goes to the bucket with ``low <= prompt_len < up``.
:meth:`RequestBuckets.adjust` merges everything back into one bucket when fewer than ``N_max`` requests are
queued; otherwise it splits, once per call, every bucket that holds more than ``N_max`` requests of which more
than ``theta`` lie below its split point, into ``[low, split)`` and ``[split, up)``.

Split points snap to warmed query lengths: a cut sits at ``q + 1`` for a warmed length ``q``, so every request
of a bucket pads to a warmed shape no longer than the one its bucket's upper end pads to, and no split ever asks
for a shape that was not compiled. A bucket without a warmed length strictly inside it is not split (its requests
already share one padded length). The cut nearest the midpoint is used.

Costs: assignment is a binary search over the ``k`` bucket bounds, O(log k) (the paper scans every bucket for
every request); within a bucket each class keeps a heap in priority order and an arrival heap, so a batch of
``b`` requests is read in O(b log m) and removed in amortised O(b log m). Removed entries are dropped from the
heaps lazily and the heaps are rebuilt when more than half of them is stale.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from bucket_manager.request import PriorityClass, RequestSummary

Key = tuple[float, ...]
_Entry = tuple[Key, int, str]  # (priority key, insertion number, request id): the number keeps ties stable
_AgeEntry = tuple[float, int, str]
CLASSES = (PriorityClass.ONLINE, PriorityClass.OFFLINE)


def arrival_key(request: RequestSummary) -> Key:
    return (request.priority, request.arrival)


@dataclass(eq=False)
class _Bucket:
    low: int
    up: int
    split_at: int | None
    below: int = 0
    # request id -> insertion number of its live entry; an entry with another number is stale
    members: dict[str, int] = field(default_factory=dict)
    order: dict[PriorityClass, list[_Entry]] = field(default_factory=lambda: {c: [] for c in CLASSES})
    ages: dict[PriorityClass, list[_AgeEntry]] = field(default_factory=lambda: {c: [] for c in CLASSES})
    counts: dict[PriorityClass, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))


class RequestBuckets:
    """The queue of requests waiting for prefill, partitioned into length buckets."""

    def __init__(
        self,
        max_len: int,
        warmed_query_lens: Iterable[int] = (),
        theta: float = 0.5,
        key: Callable[[RequestSummary], Key] = arrival_key,
    ) -> None:
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
        if not 0.0 <= theta < 1.0:
            raise ValueError(f"theta must be in [0, 1), got {theta!r}")
        self.max_len = max_len
        self.theta = theta
        self._key = key
        self._cuts = sorted({q + 1 for q in warmed_query_lens if 1 <= q < max_len})
        self._entries: dict[str, tuple[RequestSummary, Key, int]] = {}
        self._seq = 0
        self._buckets: list[_Bucket] = [self._make_bucket(0, max_len + 1, [])]
        self._lows = [0]

    # ---------------------------------------------------------------- reading
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> RequestSummary:
        return self._entries[request_id][0]

    def key_of(self, request_id: str) -> Key:
        """The priority key a queued request is ordered by."""
        return self._entries[request_id][1]

    def longest_prompt(self) -> int:
        """The longest queued prompt (0 when empty): in the highest bucket that holds any (buckets are ascending)."""
        for b in reversed(self._buckets):
            if b.members:
                return max(self._entries[rid][0].prompt_len for rid in b.members)
        return 0

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def bounds(self) -> list[tuple[int, int]]:
        """``(low, up)`` of every bucket, ascending; ``up`` is exclusive."""
        return [(b.low, b.up) for b in self._buckets]

    def sizes(self, priority_class: PriorityClass | None = None) -> list[int]:
        if priority_class is None:
            return [len(b.members) for b in self._buckets]
        return [b.counts[priority_class] for b in self._buckets]

    def count(self, priority_class: PriorityClass) -> int:
        return sum(b.counts[priority_class] for b in self._buckets)

    def bucket_index(self, prompt_len: int) -> int:
        """The bucket a prompt of this length belongs to: binary search over the bucket bounds."""
        return bisect.bisect_right(self._lows, prompt_len) - 1

    def head(self, index: int, priority_class: PriorityClass) -> tuple[Key, RequestSummary] | None:
        """The first request of a class in a bucket, with its key; heap tops are kept live by every removal."""
        heap = self._buckets[index].order[priority_class]
        if not heap:
            return None
        key, _, rid = heap[0]
        return key, self._entries[rid][0]

    def oldest(self, priority_class: PriorityClass) -> RequestSummary | None:
        """The earliest arrival of a class over all buckets (O(k))."""
        best: _AgeEntry | None = None
        for b in self._buckets:
            ages = b.ages[priority_class]
            if ages and (best is None or ages[0] < best):
                best = ages[0]
        return None if best is None else self._entries[best[2]][0]

    def ordered(self, index: int, priority_class: PriorityClass) -> Iterator[RequestSummary]:
        """The live requests of a class in a bucket, most urgent first, without changing the queue.

        Walks the heap as a tree, best first, so reading the first ``b`` costs O(b log b) whatever the size.
        """
        bucket = self._buckets[index]
        heap = bucket.order[priority_class]
        members = bucket.members
        frontier: list[tuple[_Entry, int]] = [(heap[0], 0)] if heap else []
        size = len(heap)
        while frontier:
            entry, i = heapq.heappop(frontier)
            _, seq, rid = entry
            if members.get(rid) == seq:
                yield self._entries[rid][0]
            for child in (2 * i + 1, 2 * i + 2):
                if child < size:
                    heapq.heappush(frontier, (heap[child], child))

    # --------------------------------------------------------------- changing
    def add(self, request: RequestSummary) -> int:
        """Queue a request; returns its bucket index."""
        rid = request.request_id
        if rid in self._entries:
            raise ValueError(f"request_id {rid!r} is already queued")
        if request.prompt_len > self.max_len:
            raise ValueError(f"prompt_len {request.prompt_len} is above max_len {self.max_len}")
        self._seq += 1
        key = self._key(request)
        self._entries[rid] = (request, key, self._seq)
        index = self.bucket_index(request.prompt_len)
        bucket = self._buckets[index]
        self._insert(bucket, request, key, self._seq)
        return index

    def remove(self, request_id: str) -> RequestSummary:
        request, _, _ = self._entries.pop(request_id)
        bucket = self._buckets[self.bucket_index(request.prompt_len)]
        del bucket.members[request_id]
        bucket.counts[request.priority_class] -= 1
        if bucket.split_at is not None and request.prompt_len < bucket.split_at:
            bucket.below -= 1
        self._drop_stale(bucket, request.priority_class)
        return request

    def remove_many(self, request_ids: Iterable[str]) -> list[RequestSummary]:
        return [self.remove(rid) for rid in request_ids]

    def adjust(self, n_max: int) -> bool:
        """One round of Algorithm 1's ``adjust_buckets``; True when the buckets changed."""
        if n_max < 1:
            raise ValueError(f"n_max must be >= 1, got {n_max}")
        if len(self._entries) < n_max:
            if len(self._buckets) == 1:
                return False
            self._buckets = [self._make_bucket(0, self.max_len + 1, list(self._entries))]
            self._lows = [0]
            return True
        changed = False
        result: list[_Bucket] = []
        for b in self._buckets:
            size = len(b.members)
            if b.split_at is None or size <= n_max or b.below <= self.theta * size:
                result.append(b)
                continue
            low_ids = [rid for rid in b.members if self._entries[rid][0].prompt_len < b.split_at]
            high_ids = [rid for rid in b.members if self._entries[rid][0].prompt_len >= b.split_at]
            result.append(self._make_bucket(b.low, b.split_at, low_ids))
            result.append(self._make_bucket(b.split_at, b.up, high_ids))
            changed = True
        if changed:
            self._buckets = result
            self._lows = [b.low for b in result]
        return changed

    # --------------------------------------------------------------- internal
    def _split_point(self, low: int, up: int) -> int | None:
        lo = bisect.bisect_right(self._cuts, low)
        hi = bisect.bisect_left(self._cuts, up)
        if lo >= hi:
            return None
        mid = (low + up) / 2
        j = bisect.bisect_left(self._cuts, mid, lo, hi)
        options = [self._cuts[i] for i in (j - 1, j) if lo <= i < hi]
        return min(options, key=lambda c: (abs(c - mid), c))

    def _make_bucket(self, low: int, up: int, request_ids: list[str]) -> _Bucket:
        bucket = _Bucket(low=low, up=up, split_at=self._split_point(low, up))
        for rid in request_ids:
            request, key, seq = self._entries[rid]
            bucket.members[rid] = seq
            cls = request.priority_class
            bucket.order[cls].append((key, seq, rid))
            bucket.ages[cls].append((request.arrival, seq, rid))
            bucket.counts[cls] += 1
            if bucket.split_at is not None and request.prompt_len < bucket.split_at:
                bucket.below += 1
        for cls in CLASSES:
            heapq.heapify(bucket.order[cls])
            heapq.heapify(bucket.ages[cls])
        return bucket

    def _insert(self, bucket: _Bucket, request: RequestSummary, key: Key, seq: int) -> None:
        rid = request.request_id
        cls = request.priority_class
        bucket.members[rid] = seq
        bucket.counts[cls] += 1
        heapq.heappush(bucket.order[cls], (key, seq, rid))
        heapq.heappush(bucket.ages[cls], (request.arrival, seq, rid))
        if bucket.split_at is not None and request.prompt_len < bucket.split_at:
            bucket.below += 1

    def _drop_stale(self, bucket: _Bucket, cls: PriorityClass) -> None:
        members = bucket.members
        for heap in (bucket.order[cls], bucket.ages[cls]):
            while heap and members.get(heap[0][2]) != heap[0][1]:
                heapq.heappop(heap)
        live = bucket.counts[cls]
        if len(bucket.order[cls]) > 2 * live + 64:
            # Too many stale entries below the top (requests removed out of order): rebuild from the live ones.
            ids = [rid for _, seq, rid in bucket.order[cls] if members.get(rid) == seq]
            bucket.order[cls] = [(self._entries[r][1], self._entries[r][2], r) for r in ids]
            bucket.ages[cls] = [(self._entries[r][0].arrival, self._entries[r][2], r) for r in ids]
            heapq.heapify(bucket.order[cls])
            heapq.heapify(bucket.ages[cls])
