"""The global monitor: one object the cluster reports to and reads from.

Plain Python so it can run embedded or be wrapped as a named Ray actor; every argument and
result is a frozen record, a list, a dict or a number, all cheap to pickle. Return values
of `summary()` and `dashboard_data()` are JSON-able as they are.

No caller should wait on it to serve a request, and it never waits long on its store: on Redis, a store outage
switches it to memory (degraded figures, see `fallback_store`) until Redis answers again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from monitor import accounting, metrics, sketch
from monitor.config import MonitorConfig
from monitor.records import (
    PRIORITY_CLASSES,
    BatchRecord,
    BucketState,
    RequestRecord,
    WorkerStats,
    WorkerStatus,
)
from monitor.stages import STAGES
from monitor.store import Clock, MonitorStore
from monitor.stores import create_store

# Dashboard windows up to an hour are drawn from 10 s slots, longer ones from minutes, so
# a chart never has more than a few hundred to ~1440 points.
FINE_WINDOW_LIMIT_S = 3600.0
QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


class Monitor:
    def __init__(
        self,
        config: MonitorConfig | None = None,
        *,
        clock: Clock = time.time,
        store: MonitorStore | None = None,
    ) -> None:
        self.config = config or MonitorConfig()
        self.clock = clock
        self.store = store if store is not None else create_store(self.config, clock)

    def close(self) -> None:
        self.store.close()

    # ------------------------------------------------------------ writes

    def report_worker(self, stats: WorkerStats) -> None:
        """A worker's heartbeat; call it every few seconds (well inside heartbeat_ttl_s)."""
        self.store.put_worker(stats)

    def record_request(self, rec: RequestRecord) -> bool:
        """A finished or failed request; False when this id was already recorded."""
        return self.store.add_request(rec)

    def record_arrival(self, priority_class: str, prompt_tokens: int, timestamp: float | None = None) -> None:
        """A request admitted by the gateway: feeds the arrival rate and mean prompt length."""
        self.store.add_arrival(priority_class, prompt_tokens, timestamp)

    def record_transfer(
        self, priority_class: str, nbytes: int, seconds: float, transport: str = "grpc"
    ) -> None:
        """One acknowledged prefill-to-decode KV transfer (``kv_transfer_bytes{transport}``,
        ``kv_transfer_latency``); ``transport``: how it went ("shm", "grpc", "grpc+tls", ...)."""
        self.store.add_transfer(priority_class, nbytes, seconds, transport)

    def record_scaling(self, role: str, direction: str) -> None:
        """The autoscaler added ("up") or began draining ("down") a worker of ``role``
        (``scaling_events_total{role, direction}``)."""
        self.store.add_scaling(role, direction)

    def record_lent_batch(self, worker_id: str, prompts: int) -> None:
        """The controller lent decode worker ``worker_id`` a batch of ``prompts`` prompts to prefill itself
        (``lent_prompt_batches_total`` / ``lent_prompts_total{worker}``)."""
        self.store.add_lent_batch(worker_id, prompts)

    def record_core_lend(self, worker_id: str) -> None:
        """A prefill batch ran on decode worker ``worker_id``'s cores too (idle, or paused), or a colocated worker's
        step on colocated worker ``worker_id``'s (``lent_core_batches_total{worker}``)."""
        self.store.add_core_lend(worker_id)

    def record_batch(self, rec: BatchRecord) -> None:
        """One executed batch: batch-size histogram and padding waste."""
        self.store.add_batch(rec)

    def set_buckets(
        self, boundaries: Sequence[int], queue_depths: Sequence[int], timestamp: float | None = None
    ) -> None:
        """The controller's current request buckets [b_i, b_i+1) and the queue in each."""
        t = self.clock() if timestamp is None else timestamp
        self.store.set_buckets(BucketState(tuple(boundaries), tuple(queue_depths), t))

    # ------------------------------------------------------------ reads

    def request(self, request_id: str) -> RequestRecord | None:
        """The record of one finished request (kept for the retention window), or None."""
        return self.store.get_request(request_id)

    def workers(self) -> list[WorkerStatus]:
        return self.store.workers()

    def summary(self) -> dict[str, Any]:
        """The latest figures the bucketing controller sizes batches and picks workers from."""
        now = self.clock()
        window = self.config.rate_window_s
        slots = self.store.series(10, now - window, now)
        span = max(now - slots[0].start, 1e-9) if slots else window
        by_class = accounting.aggregate(slots)
        total = accounting.ClassSlot()
        for c in by_class.values():
            total.merge(c)
        statuses = self.store.workers()
        state = self.store.buckets()
        return {
            "time": now,
            "window_s": window,
            "workers": {s.stats.worker_id: _worker_row(s, now) for s in statuses},
            # Only live workers are candidates for placement.
            "free_kv_blocks": {s.stats.worker_id: s.stats.kv_blocks_free for s in statuses if s.up},
            "queue_lengths": {s.stats.worker_id: s.stats.queue_len for s in statuses if s.up},
            "arrival_rate_rps": total.arrivals / span,
            "completion_rate_rps": total.requests / span,
            "mean_prompt_tokens": total.arrival_tokens / total.arrivals if total.arrivals else None,
            "mean_seq_tokens": (
                (total.prompt_tokens + total.output_tokens) / total.requests if total.requests else None
            ),
            "slo_attainment": {
                cls: (c.slo_met / c.requests if c.requests else None) for cls, c in by_class.items()
            },
            "buckets": _bucket_dict(state),
        }

    def metrics_text(self, model_name: str) -> str:
        """Prometheus text exposition for `GET /metrics` (content type: metrics.CONTENT_TYPE)."""
        return metrics.render(self.store, model_name, self.config.rate_window_s)

    def dashboard_data(self, window_s: float = 900.0) -> dict[str, Any]:
        """Everything the dashboard page draws, for the last window_s seconds."""
        now = self.clock()
        window_s = min(max(float(window_s), 60.0), self.config.retention_s)
        res = 10 if window_s <= FINE_WINDOW_LIMIT_S else 60
        slots = self.store.series(res, now - window_s, now)
        statuses = self.store.workers()
        worker_ids = [s.stats.worker_id for s in statuses]

        def per_class(fn: Any) -> dict[str, list[float | None]]:
            return {cls: [fn(s.classes[cls]) for s in slots] for cls in PRIORITY_CLASSES}

        totals = self.store.totals()
        totals_per_slot = [s.total() for s in slots]
        window = accounting.aggregate(slots)
        return {
            "time": now,
            "window_s": window_s,
            "resolution_s": res,
            "classes": list(PRIORITY_CLASSES),
            "t": [s.start for s in slots],
            "slo_attainment": per_class(lambda c: c.slo_met / c.requests if c.requests else None),
            "goodput_rps": per_class(lambda c: c.slo_met / res),
            "request_rate_rps": per_class(lambda c: c.requests / res),
            "arrival_rate_rps": [c.arrivals / res for c in totals_per_slot],
            "tokens_per_s": {
                "prompt": [c.prompt_tokens / res for c in totals_per_slot],
                "output": [c.output_tokens / res for c in totals_per_slot],
            },
            "ttft_ms": {
                name: [sketch.quantile(c.ttft_bins, q) for c in totals_per_slot] for name, q in QUANTILES
            },
            "tpot_ms": {
                name: [sketch.quantile(c.tpot_bins, q) for c in totals_per_slot] for name, q in QUANTILES
            },
            "queue_depth": [s.queue_depth for s in slots],
            "bucket_count": [s.bucket_count for s in slots],
            "worker_kv_usage": {w: [s.worker_kv_usage.get(w) for s in slots] for w in worker_ids},
            "worker_free_memory_bytes": {w: [s.worker_free_memory.get(w) for s in slots] for w in worker_ids},
            "window_totals": {
                cls: {
                    "requests": c.requests,
                    "slo_met": c.slo_met,
                    "errors": c.errors,
                    "slo_attainment": c.slo_met / c.requests if c.requests else None,
                    "ttft_ms": {name: sketch.quantile(c.ttft_bins, q) for name, q in QUANTILES},
                    "tpot_ms": {name: sketch.quantile(c.tpot_bins, q) for name, q in QUANTILES},
                }
                for cls, c in window.items()
            },
            # Where the time to first token went over the window, stage by stage (monitor/stages.py), in order.
            "stages": {
                name: summary.as_dict()
                for name, summary in sorted(
                    accounting.aggregate_stages(slots).items(),
                    key=lambda kv: STAGES.index(kv[0]) if kv[0] in STAGES else len(STAGES),
                )
            },
            "buckets": _bucket_dict(self.store.buckets()),
            "workers": [_worker_row(s, now) for s in statuses],
            "runtime_compilations": sum(s.stats.runtime_compilations for s in statuses),
            "scaling_events": _scaling_events(totals),
            # Prompt batches (and prompts) each decode worker prefilled itself, and prefill batches that ran on its
            # cores too (elastic prefill), since the start.
            "lending": {
                worker: {k: int(v) for k, v in counts.items()}
                for worker, counts in accounting.decode_lent(totals).items()
            },
        }

    def check(self) -> list[str]:
        """Invariant breaches visible from here; empty when all is well.

        - a worker whose heartbeat lapsed;
        - an idle worker (nothing running or queued) whose used + free KV blocks != total:
          blocks leaked;
        - a warmed worker that compiled at run time (a batch fell outside every warmed shape);
        - totals where more requests met their SLO than finished;
        - a shared store (Redis) that is down, so these figures come from memory (degraded).
        """
        now = self.clock()
        problems = []
        outage = self.store.outage()
        if outage is not None:
            problems.append(outage)
        for status in self.store.workers():
            s = status.stats
            if not status.up:
                problems.append(
                    f"worker {s.worker_id} is down: no heartbeat for {now - status.last_seen:.1f} s "
                    f"(ttl {self.config.heartbeat_ttl_s:g} s)"
                )
            elif (
                s.running == 0
                and s.queue_len == 0
                and s.kv_blocks_used + s.kv_blocks_free != s.kv_blocks_total
            ):
                problems.append(
                    f"worker {s.worker_id} leaks KV blocks: idle with used {s.kv_blocks_used} + free "
                    f"{s.kv_blocks_free} != total {s.kv_blocks_total}"
                )
            if s.warmed and s.runtime_compilations > 0:
                problems.append(
                    f"worker {s.worker_id} compiled {s.runtime_compilations} shape(s) while serving"
                )
        totals = self.store.totals()
        for cls in PRIORITY_CLASSES:
            finished = sum(v for k, v in totals.items() if k.startswith(f"req|{cls}|"))
            if totals.get(f"slo|{cls}", 0.0) > finished:
                problems.append(
                    f"{cls}: {totals[f'slo|{cls}']:g} SLO hits for {finished:g} finished requests"
                )
        return problems


def _scaling_events(totals: dict[str, float]) -> dict[str, dict[str, int]]:
    """Workers the autoscaler added and began draining, per role, since the store began."""
    return {
        role: {d: int(totals.get(f"scale|{role}|{d}", 0)) for d in ("up", "down")}
        for role in ("prefill", "decode")
    }


def _worker_row(status: WorkerStatus, now: float) -> dict[str, Any]:
    row = status.stats.to_dict()
    row.update(
        up=status.up, last_seen=status.last_seen, age_s=now - status.last_seen, kv_usage=status.stats.kv_usage
    )
    return row


def _bucket_dict(state: BucketState | None) -> dict[str, Any] | None:
    if state is None:
        return None
    return {
        "boundaries": list(state.boundaries),
        "queue_depths": list(state.queue_depths),
        "labels": state.labels,
        "timestamp": state.timestamp,
    }
