"""MonitorStore: where the monitor keeps worker stats, request records and rolled-up series.

The interface is concrete on top and small underneath: the public methods (shared by every
backend) turn records into hash-field increments with `accounting`, and a backend only
implements a handful of storage primitives. That keeps the memory and Redis backends
from drifting apart; one contract test suite runs against both.

Memory is bounded in every backend:
- worker stats: one entry per worker, dropped after `retention_s` without a heartbeat;
- request records: at most `max_requests`, each kept at most `retention_s`;
- series: one hash per slot and resolution, expiring `retention_s` after its last write,
  each with at most 2 classes x (8 counters + 2 latency sketches of <= sketch.MAX_BINS
  bins) plus two last-value fields per worker;
- totals: fixed by the label sets (classes, finish reasons, roles, histogram buckets).
"""

from __future__ import annotations

import json
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from monitor import accounting
from monitor.config import RESOLUTIONS_S, MonitorConfig
from monitor.records import (
    PRIORITY_CLASSES,
    BatchRecord,
    BucketState,
    RequestRecord,
    WorkerStats,
    WorkerStatus,
)

Clock = Callable[[], float]

# A KV transfer's route as it becomes a metric label (and part of a Redis hash field): short, no separators.
_TRANSPORT_NAME = re.compile(r"[a-z][a-z0-9_+]{0,31}")


@dataclass(frozen=True)
class HashOp:
    """Add `incr` to numeric fields and overwrite `set` fields of one hash, then (re)arm its TTL."""

    key: str
    incr: dict[str, float] = field(default_factory=dict)
    set: dict[str, float] = field(default_factory=dict)
    ttl_s: float | None = None


class MonitorStore(ABC):
    # Errors that mean "the store cannot be reached now" (a shared store's outage), as opposed to a bug: a
    # FallbackStore answers from memory on these.
    outage_errors: tuple[type[Exception], ...] = ()

    def __init__(self, config: MonitorConfig, clock: Clock = time.time) -> None:
        self.config = config
        self.clock = clock

    # ------------------------------------------------------------ backend primitives

    @abstractmethod
    def _apply(self, ops: list[HashOp]) -> None: ...

    @abstractmethod
    def _read(self, keys: list[str]) -> list[dict[str, float]]: ...

    @abstractmethod
    def _put_worker(self, worker_id: str, doc: str) -> None: ...

    @abstractmethod
    def _get_workers(self) -> dict[str, str]: ...

    @abstractmethod
    def _del_worker(self, worker_id: str) -> None: ...

    @abstractmethod
    def _put_request(self, request_id: str, doc: str, ttl_s: float) -> bool:
        """Store a record unless one with this id is already there; True when stored."""

    @abstractmethod
    def _get_request(self, request_id: str) -> str | None: ...

    @abstractmethod
    def _recent_requests(self, limit: int) -> list[str]:
        """Newest first."""

    @abstractmethod
    def _put_doc(self, name: str, doc: str) -> None: ...

    @abstractmethod
    def _get_doc(self, name: str) -> str | None: ...

    def close(self) -> None:  # noqa: B027 - optional hook, the memory store holds nothing open
        pass

    def ping(self) -> None:  # noqa: B027 - optional hook, the memory store is always there
        """Raise one of ``outage_errors`` when the store cannot be reached."""

    def outage(self) -> str | None:
        """What is wrong with the store while it answers from a stand-in (degraded figures); None when well."""
        return None

    # ------------------------------------------------------------ workers

    def put_worker(self, stats: WorkerStats) -> None:
        now = self.clock()
        doc = json.dumps({"stats": stats.to_dict(), "last_seen": now})
        self._put_worker(stats.worker_id, doc)
        self._apply(self._slot_ops(now, set_fields=accounting.worker_slot_fields(stats)))

    def workers(self) -> list[WorkerStatus]:
        """Every worker heard from within the retention window, sorted by id; up = heartbeat fresh."""
        now = self.clock()
        out = []
        for worker_id, doc in sorted(self._get_workers().items()):
            data = json.loads(doc)
            last_seen = float(data["last_seen"])
            if now - last_seen > self.config.retention_s:
                self._del_worker(worker_id)  # a long-gone worker stops costing memory
                continue
            up = now - last_seen <= self.config.heartbeat_ttl_s
            out.append(WorkerStatus(WorkerStats.from_dict(data["stats"]), last_seen, up))
        return out

    def forget_worker(self, worker_id: str) -> None:
        self._del_worker(worker_id)

    # ------------------------------------------------------------ requests

    def add_request(self, rec: RequestRecord) -> bool:
        """Record a finished request once; a repeat of the same id is ignored (False), so a
        retried report never double-counts."""
        if not self._put_request(rec.request_id, json.dumps(rec.to_dict()), self.config.retention_s):
            return False
        ops = [HashOp(accounting.TOTALS_KEY, incr=accounting.request_totals(rec))]
        ops += self._slot_ops(rec.finished_at, incr=accounting.request_slot(rec))
        self._apply(ops)
        return True

    def get_request(self, request_id: str) -> RequestRecord | None:
        doc = self._get_request(request_id)
        return RequestRecord.from_dict(json.loads(doc)) if doc is not None else None

    def recent_requests(self, limit: int = 100) -> list[RequestRecord]:
        return [RequestRecord.from_dict(json.loads(d)) for d in self._recent_requests(limit)]

    def add_arrival(self, priority_class: str, prompt_tokens: int, timestamp: float | None = None) -> None:
        """Count a request as it arrives (records come only when it finishes, too late for rates)."""
        if priority_class not in PRIORITY_CLASSES:
            raise ValueError(f"priority_class must be one of {PRIORITY_CLASSES}, got {priority_class!r}")
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an int >= 0, got {prompt_tokens!r}")
        t = self.clock() if timestamp is None else timestamp
        self._apply(self._slot_ops(t, incr=accounting.arrival_slot(priority_class, prompt_tokens)))

    # ------------------------------------------------------------ batches, buckets, totals

    def add_transfer(self, priority_class: str, nbytes: int, seconds: float, transport: str = "grpc") -> None:
        if not isinstance(transport, str) or not _TRANSPORT_NAME.fullmatch(transport):
            raise ValueError(f"transport must be a short name such as 'grpc+tls', got {transport!r}")
        if priority_class not in PRIORITY_CLASSES:
            raise ValueError(f"priority_class must be one of {PRIORITY_CLASSES}, got {priority_class!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        if not (isinstance(seconds, int | float) and seconds >= 0):
            raise ValueError(f"seconds must be a number >= 0, got {seconds!r}")
        self._apply(
            [
                HashOp(
                    accounting.TOTALS_KEY,
                    incr=accounting.transfer_totals(priority_class, nbytes, seconds, transport),
                )
            ]
        )

    def add_scaling(self, role: str, direction: str) -> None:
        if role not in ("prefill", "decode") or direction not in ("up", "down"):
            raise ValueError(f"a scaling event is (prefill|decode, up|down), got {(role, direction)!r}")
        self._apply([HashOp(accounting.TOTALS_KEY, incr={f"scale|{role}|{direction}": 1})])

    def add_lent_batch(self, worker_id: str, prompts: int) -> None:
        """A decode worker was lent a batch of ``prompts`` prompts to prefill itself (elastic prefill)."""
        if not worker_id or isinstance(prompts, bool) or not isinstance(prompts, int) or prompts < 1:
            raise ValueError(f"a lent batch is (worker id, prompts >= 1), got {(worker_id, prompts)!r}")
        self._apply([HashOp(accounting.TOTALS_KEY, incr=accounting.lent_totals(worker_id, prompts))])

    def add_core_lend(self, worker_id: str) -> None:
        """A prefill batch ran on decode worker ``worker_id``'s cores too (idle, or paused; elastic prefill)."""
        if not worker_id or not isinstance(worker_id, str):
            raise ValueError(f"a core lend names its decode worker, got {worker_id!r}")
        self._apply([HashOp(accounting.TOTALS_KEY, incr=accounting.core_lent_totals(worker_id))])

    def add_batch(self, rec: BatchRecord) -> None:
        self._apply([HashOp(accounting.TOTALS_KEY, incr=accounting.batch_totals(rec))])

    def set_buckets(self, state: BucketState) -> None:
        self._put_doc("buckets", json.dumps(state.to_dict()))
        self._apply(self._slot_ops(self.clock(), set_fields=accounting.bucket_slot_fields(state)))

    def buckets(self) -> BucketState | None:
        doc = self._get_doc("buckets")
        return BucketState.from_dict(json.loads(doc)) if doc is not None else None

    def totals(self) -> dict[str, float]:
        """The cumulative counters and histograms (see `accounting`)."""
        return self._read([accounting.TOTALS_KEY])[0]

    # ------------------------------------------------------------ series

    def series(self, resolution_s: int, start: float, end: float) -> list[accounting.SeriesSlot]:
        """Every slot from start to end (inclusive), empty slots included, oldest first."""
        if resolution_s not in RESOLUTIONS_S:
            raise ValueError(f"resolution_s must be one of {RESOLUTIONS_S}, got {resolution_s!r}")
        # Nothing older than the retention window is kept, so never ask for it.
        start = max(start, self.clock() - self.config.retention_s)
        first, last = accounting.slot_start(start, resolution_s), accounting.slot_start(end, resolution_s)
        starts = list(range(first, last + 1, resolution_s))
        raws = self._read([accounting.slot_key(resolution_s, s) for s in starts]) if starts else []
        return [accounting.decode_slot(s, raw) for s, raw in zip(starts, raws, strict=True)]

    def _slot_ops(
        self, t: float, incr: dict[str, float] | None = None, set_fields: dict[str, float] | None = None
    ) -> list[HashOp]:
        # A record older than the window would never be read again; counting it only in
        # the totals keeps stale slots from being created.
        if t < self.clock() - self.config.retention_s:
            return []
        ttl = self.config.retention_s
        return [
            HashOp(
                accounting.slot_key(res, accounting.slot_start(t, res)),
                incr=dict(incr or {}),
                set=dict(set_fields or {}),
                ttl_s=ttl + res,
            )
            for res in RESOLUTIONS_S
        ]
