"""Typed records that workers, the gateway and the controller hand to the monitor.

All records are frozen dataclasses of plain values so they pickle cheaply across Ray actor
calls and round-trip through JSON for the Redis store. Times are Unix seconds (floats);
durations carry their unit in the field name.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from monitor.stages import STAGES

Role = Literal["prefill", "decode", "colocated"]
PriorityClass = Literal["online", "offline"]
FinishReason = Literal["stop", "length", "abort", "error"]

ROLES: tuple[str, ...] = ("prefill", "decode", "colocated")
PRIORITY_CLASSES: tuple[str, ...] = ("online", "offline")
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")
# A request that stopped on EOS/stop string or on max_tokens counts as a success, as in vLLM.
SUCCESS_REASONS: tuple[str, ...] = ("stop", "length")


def _fail(record: str, field: str, why: str, value: Any) -> None:
    raise ValueError(f"{record}.{field} {why}, got {value!r}")


def _non_negative(record: str, obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            _fail(record, name, "must be a number", value)
        if math.isnan(value) or value < 0:
            _fail(record, name, "must be >= 0", value)


class _JsonRecord:
    """JSON round-trip shared by the records (tuples come back from JSON as lists)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        # Unknown keys are dropped so that a newer writer does not break an older reader.
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class WorkerStats(_JsonRecord):
    """One heartbeat from a prefill, decode or colocated worker."""

    worker_id: str
    role: Role
    free_memory_bytes: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    queue_len: int
    running: int
    batch_latency_ms: float | None
    runtime_compilations: int
    warmed: bool
    timestamp: float

    def __post_init__(self) -> None:
        name = "WorkerStats"
        if not isinstance(self.worker_id, str) or not self.worker_id:
            _fail(name, "worker_id", "must be a non-empty string", self.worker_id)
        if self.role not in ROLES:
            _fail(name, "role", f"must be one of {ROLES}", self.role)
        _non_negative(
            name,
            self,
            (
                "free_memory_bytes",
                "kv_blocks_total",
                "kv_blocks_used",
                "kv_blocks_free",
                "queue_len",
                "running",
                "batch_latency_ms",
                "runtime_compilations",
                "timestamp",
            ),
        )
        # Blocks in flight to another worker may be neither used nor free, so only the
        # upper bound is a hard error; the idle equality is checked by Monitor.check().
        if self.kv_blocks_used + self.kv_blocks_free > self.kv_blocks_total:
            _fail(
                name,
                "kv_blocks_used",
                f"+ kv_blocks_free must be <= kv_blocks_total ({self.kv_blocks_total})",
                self.kv_blocks_used,
            )
        if not isinstance(self.warmed, bool):
            _fail(name, "warmed", "must be a bool", self.warmed)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (0 for a worker without a cache)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class RequestRecord(_JsonRecord):
    """What one finished (or failed) request cost, written once by the gateway."""

    request_id: str
    arrival: float
    priority_class: PriorityClass
    prompt_tokens: int
    output_tokens: int
    finish_reason: FinishReason
    slo_met: bool
    queue_s: float | None = None
    prefill_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    bucket: tuple[int, int] | None = None
    error: str | None = None
    # Seconds per stage of its way through the cluster (``monitor/stages.py``); None when not measured.
    stages: dict[str, float] | None = None

    def __post_init__(self) -> None:
        name = "RequestRecord"
        if not isinstance(self.request_id, str) or not self.request_id:
            _fail(name, "request_id", "must be a non-empty string", self.request_id)
        if self.priority_class not in PRIORITY_CLASSES:
            _fail(name, "priority_class", f"must be one of {PRIORITY_CLASSES}", self.priority_class)
        if self.finish_reason not in FINISH_REASONS:
            _fail(name, "finish_reason", f"must be one of {FINISH_REASONS}", self.finish_reason)
        _non_negative(
            name,
            self,
            (
                "arrival",
                "prompt_tokens",
                "output_tokens",
                "queue_s",
                "prefill_s",
                "ttft_s",
                "tpot_s",
                "e2e_s",
            ),
        )
        if not isinstance(self.slo_met, bool):
            _fail(name, "slo_met", "must be a bool", self.slo_met)
        if self.slo_met and not self.succeeded:
            _fail(name, "slo_met", f"cannot be True for finish_reason {self.finish_reason!r}", self.slo_met)
        if self.bucket is not None:
            bucket = tuple(self.bucket)
            if len(bucket) != 2 or not all(isinstance(b, int) for b in bucket) or bucket[0] >= bucket[1]:
                _fail(name, "bucket", "must be (low, high) ints with low < high", self.bucket)
            # JSON gives lists back; keep the declared tuple type either way.
            object.__setattr__(self, "bucket", bucket)
        if self.stages is not None:
            if not isinstance(self.stages, dict):
                _fail(name, "stages", "must be a dict of stage name -> seconds", self.stages)
            for stage, seconds in self.stages.items():
                if stage not in STAGES:
                    _fail(
                        name, "stages", f"names unknown stage {stage!r} (known: {', '.join(STAGES)})", stage
                    )
                if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
                    _fail(name, "stages", f"[{stage!r}] must be a number of seconds >= 0", seconds)

    @property
    def succeeded(self) -> bool:
        return self.finish_reason in SUCCESS_REASONS

    @property
    def finished_at(self) -> float:
        """When the request left the system; a failure without a latency counts at arrival."""
        return self.arrival + (self.e2e_s or 0.0)


@dataclass(frozen=True)
class BatchRecord(_JsonRecord):
    """One executed batch: its real size and the warmed shape it was padded to."""

    worker_id: str
    role: Role
    batch_size: int
    real_tokens: int
    padded_tokens: int
    timestamp: float

    def __post_init__(self) -> None:
        name = "BatchRecord"
        if not isinstance(self.worker_id, str) or not self.worker_id:
            _fail(name, "worker_id", "must be a non-empty string", self.worker_id)
        if self.role not in ROLES:
            _fail(name, "role", f"must be one of {ROLES}", self.role)
        _non_negative(name, self, ("batch_size", "real_tokens", "padded_tokens", "timestamp"))
        if self.padded_tokens < self.real_tokens:
            _fail(name, "padded_tokens", f"must be >= real_tokens ({self.real_tokens})", self.padded_tokens)


@dataclass(frozen=True)
class BucketState(_JsonRecord):
    """The controller's request buckets: edges b0 < b1 < ... < bn make n buckets [b_i, b_i+1)."""

    boundaries: tuple[int, ...]
    queue_depths: tuple[int, ...]
    timestamp: float

    def __post_init__(self) -> None:
        name = "BucketState"
        edges = tuple(self.boundaries)
        depths = tuple(self.queue_depths)
        if len(edges) < 2 or not all(isinstance(b, int) and not isinstance(b, bool) for b in edges):
            _fail(name, "boundaries", "must be at least two int edges", self.boundaries)
        if any(a >= b for a, b in zip(edges, edges[1:], strict=False)) or edges[0] < 0:
            _fail(name, "boundaries", "must be non-negative and strictly increasing", self.boundaries)
        if len(depths) != len(edges) - 1:
            _fail(
                name, "queue_depths", f"must have one entry per bucket ({len(edges) - 1})", self.queue_depths
            )
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in depths):
            _fail(name, "queue_depths", "must be non-negative ints", self.queue_depths)
        _non_negative(name, self, ("timestamp",))
        object.__setattr__(self, "boundaries", edges)
        object.__setattr__(self, "queue_depths", depths)

    @property
    def labels(self) -> list[str]:
        return [f"{lo}-{hi}" for lo, hi in zip(self.boundaries, self.boundaries[1:], strict=False)]


@dataclass(frozen=True)
class WorkerStatus:
    """A worker's latest stats as the store sees them, with liveness."""

    stats: WorkerStats
    last_seen: float
    up: bool
