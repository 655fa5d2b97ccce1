"""How records become counters: the one place both store backends and /metrics agree on.

A store is, underneath, a set of hashes of numeric fields. Records turn into field
increments (plus a few last-value fields), which every backend applies the same way and
reads back as plain {field: number} maps; this module builds and decodes those maps. Field
names are `kind|label|...` strings so that one Redis hash holds a whole slot.

Two kinds of hash:
- the cumulative totals (never expire): Prometheus counters and histograms;
- one hash per time slot and resolution (10 s, 60 s), kept for the retention window:
  counts, tokens, SLO hits, and latency sketches (see `sketch`) per priority class.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field

from monitor import sketch
from monitor.records import PRIORITY_CLASSES, BatchRecord, BucketState, RequestRecord, WorkerStats

# Prometheus histogram upper bounds (seconds), the same as vLLM's so existing panels fit.
_TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
# vLLM uses its end-to-end bounds for the queue time as well.
_REQUEST_BOUNDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_KV_TRANSFER_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
_BATCH_BOUNDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
# The stages of a request's way (monitor/stages.py) run from tens of microseconds (a hop) to queueing seconds.
_STAGE_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # fmt: skip

HISTOGRAM_BOUNDS: dict[str, tuple[float, ...]] = {
    "ttft": _TTFT_BOUNDS,
    "itl": _ITL_BOUNDS,
    "e2e": _REQUEST_BOUNDS,
    "queue": _REQUEST_BOUNDS,
    "kv_transfer": _KV_TRANSFER_BOUNDS,
    "batch_size": _BATCH_BOUNDS,
    "stage": _STAGE_BOUNDS,
}

TOTALS_KEY = "totals"


def slot_key(resolution_s: int, slot_start: int) -> str:
    return f"ts:{resolution_s}:{slot_start}"


def slot_start(t: float, resolution_s: int) -> int:
    return int(t // resolution_s) * resolution_s


def _observe(out: dict[str, float], hist: str, label: str, value: float, weight: float = 1.0) -> None:
    bounds = HISTOGRAM_BOUNDS[hist]
    # bisect_left puts a value equal to a bound in that bound's bucket (le is inclusive).
    out_index = bisect_left(bounds, value)
    _add(out, f"h|{hist}|{label}|{out_index}", weight)
    _add(out, f"hs|{hist}|{label}", value * weight)
    _add(out, f"hc|{hist}|{label}", weight)


def _add(out: dict[str, float], name: str, value: float) -> None:
    out[name] = out.get(name, 0.0) + value


def request_totals(rec: RequestRecord) -> dict[str, float]:
    """Increments to the cumulative totals for one finished request."""
    cls = rec.priority_class
    out: dict[str, float] = {}
    _add(out, f"req|{cls}|{rec.finish_reason}", 1)
    _add(out, f"slo|{cls}", 1 if rec.slo_met else 0)
    _add(out, f"ptok|{cls}", rec.prompt_tokens)
    _add(out, f"otok|{cls}", rec.output_tokens)
    if rec.ttft_s is not None:
        _observe(out, "ttft", cls, rec.ttft_s)
    # TPOT is the mean gap between output tokens; it stands for each of the request's
    # (output_tokens - 1) gaps so the histogram counts tokens, as vLLM's inter-token one does.
    if rec.tpot_s is not None and rec.output_tokens > 1:
        _observe(out, "itl", cls, rec.tpot_s, weight=rec.output_tokens - 1)
    if rec.e2e_s is not None:
        _observe(out, "e2e", cls, rec.e2e_s)
    if rec.queue_s is not None:
        _observe(out, "queue", cls, rec.queue_s)
    for stage, seconds in (rec.stages or {}).items():
        _observe(out, "stage", stage, seconds)
    return out


def request_slot(rec: RequestRecord) -> dict[str, float]:
    """Increments to the time slot the request finished in."""
    cls = rec.priority_class
    out: dict[str, float] = {}
    _add(out, f"n|{cls}", 1)
    _add(out, f"met|{cls}", 1 if rec.slo_met else 0)
    _add(out, f"err|{cls}", 0 if rec.succeeded else 1)
    _add(out, f"ptok|{cls}", rec.prompt_tokens)
    _add(out, f"otok|{cls}", rec.output_tokens)
    _add(out, f"goodtok|{cls}", rec.output_tokens if rec.slo_met else 0)
    if rec.ttft_s is not None:
        _add(out, f"ttft|{cls}|{sketch.bin_index(rec.ttft_s * 1000.0)}", 1)
    if rec.tpot_s is not None and rec.output_tokens > 1:
        _add(out, f"tpot|{cls}|{sketch.bin_index(rec.tpot_s * 1000.0)}", 1)
    # Stages across classes: where the time goes is a property of the serving path, not of the class.
    for stage, seconds in (rec.stages or {}).items():
        _add(out, f"stg|{stage}|{sketch.bin_index(seconds * 1000.0)}", 1)
        _add(out, f"stgsum|{stage}", seconds * 1000.0)
    return out


def arrival_slot(priority_class: str, prompt_tokens: int) -> dict[str, float]:
    return {f"arr|{priority_class}": 1, f"arrtok|{priority_class}": float(prompt_tokens)}


def transfer_totals(priority_class: str, nbytes: int, seconds: float, transport: str) -> dict[str, float]:
    """One acknowledged KV transfer, as the prefill worker reports it: bytes (by the way they went) and latency."""
    out: dict[str, float] = {}
    _add(out, f"kvbytes|{transport}", nbytes)
    _observe(out, "kv_transfer", priority_class, seconds)
    return out


def lent_totals(worker_id: str, prompts: int) -> dict[str, float]:
    """One prompt batch lent to decode worker ``worker_id`` (elastic prefill)."""
    return {f"lent|{worker_id}": 1, f"lentp|{worker_id}": float(prompts)}


def core_lent_totals(worker_id: str) -> dict[str, float]:
    """One prompt batch that ran on decode worker ``worker_id``'s cores too (it was idle)."""
    return {f"lentc|{worker_id}": 1}


_LENT_KINDS = {"lent": "batches", "lentp": "prompts", "lentc": "core_batches"}


def decode_lent(totals: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """{decode worker: {"batches": ..., "prompts": ..., "core_batches": ...}} lent to it (prompt batches it
    prefilled itself, their prompts, and prefill batches that borrowed its cores), from the cumulative totals."""
    out: dict[str, dict[str, float]] = {}
    for name, value in totals.items():
        kind, _, worker = name.partition("|")
        if kind in _LENT_KINDS:
            out.setdefault(worker, dict.fromkeys(_LENT_KINDS.values(), 0.0))[_LENT_KINDS[kind]] = value
    return out


def batch_totals(rec: BatchRecord) -> dict[str, float]:
    out: dict[str, float] = {}
    _observe(out, "batch_size", rec.role, rec.batch_size)
    _add(out, f"pad|{rec.role}|real", rec.real_tokens)
    _add(out, f"pad|{rec.role}|padded", rec.padded_tokens)
    return out


def bucket_slot_fields(state: BucketState) -> dict[str, float]:
    """Last-value fields: the queue and bucket count as last pushed within the slot."""
    return {"bq": float(sum(state.queue_depths)), "bn": float(len(state.queue_depths))}


def worker_slot_fields(stats: WorkerStats) -> dict[str, float]:
    return {
        f"wkv|{stats.worker_id}": stats.kv_usage,
        f"wmem|{stats.worker_id}": float(stats.free_memory_bytes),
    }


# ---------------------------------------------------------------- decoding


@dataclass
class ClassSlot:
    requests: float = 0.0
    slo_met: float = 0.0
    errors: float = 0.0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    good_tokens: float = 0.0
    arrivals: float = 0.0
    arrival_tokens: float = 0.0
    ttft_bins: dict[int, float] = field(default_factory=dict)
    tpot_bins: dict[int, float] = field(default_factory=dict)

    def merge(self, other: ClassSlot) -> None:
        for name in (
            "requests",
            "slo_met",
            "errors",
            "prompt_tokens",
            "output_tokens",
            "good_tokens",
            "arrivals",
            "arrival_tokens",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        sketch.merge(self.ttft_bins, other.ttft_bins)
        sketch.merge(self.tpot_bins, other.tpot_bins)


@dataclass
class SeriesSlot:
    start: int
    classes: dict[str, ClassSlot]
    queue_depth: float | None = None
    bucket_count: float | None = None
    worker_kv_usage: dict[str, float] = field(default_factory=dict)
    worker_free_memory: dict[str, float] = field(default_factory=dict)
    # Per stage of the request path: a latency sketch (ms) and the sum of its values (ms).
    stage_bins: dict[str, dict[int, float]] = field(default_factory=dict)
    stage_sum_ms: dict[str, float] = field(default_factory=dict)

    def total(self) -> ClassSlot:
        out = ClassSlot()
        for c in self.classes.values():
            out.merge(c)
        return out


_SCALARS = {
    "n": "requests",
    "met": "slo_met",
    "err": "errors",
    "ptok": "prompt_tokens",
    "otok": "output_tokens",
    "goodtok": "good_tokens",
    "arr": "arrivals",
    "arrtok": "arrival_tokens",
}


def decode_slot(start: int, raw: Mapping[str, float]) -> SeriesSlot:
    slot = SeriesSlot(start=start, classes={c: ClassSlot() for c in PRIORITY_CLASSES})
    for name, value in raw.items():
        kind, _, rest = name.partition("|")
        if kind in _SCALARS:
            cls = slot.classes.setdefault(rest, ClassSlot())
            setattr(cls, _SCALARS[kind], value)
        elif kind in ("ttft", "tpot"):
            cls_name, _, index = rest.partition("|")
            cls = slot.classes.setdefault(cls_name, ClassSlot())
            getattr(cls, f"{kind}_bins")[int(index)] = value
        elif kind == "bq":
            slot.queue_depth = value
        elif kind == "bn":
            slot.bucket_count = value
        elif kind == "wkv":
            slot.worker_kv_usage[rest] = value
        elif kind == "wmem":
            slot.worker_free_memory[rest] = value
        elif kind == "stg":
            stage, _, index = rest.partition("|")
            slot.stage_bins.setdefault(stage, {})[int(index)] = value
        elif kind == "stgsum":
            slot.stage_sum_ms[rest] = value
    return slot


@dataclass(frozen=True)
class Histogram:
    bounds: tuple[float, ...]
    counts: tuple[float, ...]  # per bucket, not cumulative; the last is above every bound
    total: float
    count: float


def decode_histograms(totals: Mapping[str, float]) -> dict[tuple[str, str], Histogram]:
    """{(histogram, label): Histogram} from the cumulative totals hash."""
    found: dict[tuple[str, str], dict[str, float]] = {}
    for name, value in totals.items():
        parts = name.split("|")
        if parts[0] in ("h", "hs", "hc") and parts[1] in HISTOGRAM_BOUNDS:
            key = (parts[1], parts[2])
            slot = parts[3] if parts[0] == "h" else parts[0]
            found.setdefault(key, {})[slot] = value
    out: dict[tuple[str, str], Histogram] = {}
    for (hist, label), parts in found.items():
        bounds = HISTOGRAM_BOUNDS[hist]
        counts = tuple(parts.get(str(i), 0.0) for i in range(len(bounds) + 1))
        out[(hist, label)] = Histogram(bounds, counts, parts.get("hs", 0.0), parts.get("hc", 0.0))
    return out


@dataclass
class StageSummary:
    """One stage over a run of slots: how many requests went through it, their mean and its sketch (ms)."""

    count: float = 0.0
    sum_ms: float = 0.0
    bins: dict[int, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float | None]:
        return {
            "count": self.count,
            "mean_ms": self.sum_ms / self.count if self.count else None,
            "p50_ms": sketch.quantile(self.bins, 0.5),
            "p90_ms": sketch.quantile(self.bins, 0.9),
            "p99_ms": sketch.quantile(self.bins, 0.99),
        }


def aggregate_stages(slots: list[SeriesSlot]) -> dict[str, StageSummary]:
    """Per stage (``monitor/stages.py``) over a run of slots."""
    out: dict[str, StageSummary] = {}
    for slot in slots:
        for stage, bins in slot.stage_bins.items():
            s = out.setdefault(stage, StageSummary())
            sketch.merge(s.bins, bins)
            s.count += sum(bins.values())
            s.sum_ms += slot.stage_sum_ms.get(stage, 0.0)
    return out


def aggregate(slots: list[SeriesSlot]) -> dict[str, ClassSlot]:
    """Per-class sums (sketches merged) over a run of slots."""
    out = {c: ClassSlot() for c in PRIORITY_CLASSES}
    for slot in slots:
        for name, cls in slot.classes.items():
            out.setdefault(name, ClassSlot()).merge(cls)
    return out
