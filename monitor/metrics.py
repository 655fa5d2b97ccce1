"""Prometheus text exposition of a store's state, with names aligned to vLLM's.

Every family carries `model_name`. The latency histograms, token counters and request
counters also carry `priority_class` (online|offline); per-worker gauges carry
`worker_id` and `role`. As in vLLM, `kv_cache_usage_perc` is a fraction (1.0 = full).

The families are built fresh on each scrape from the store (so every gateway replica
sharing a Redis store exposes the same cumulative numbers) and rendered through a private
CollectorRegistry, never the process-global one.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from monitor import accounting
from monitor.records import FINISH_REASONS, PRIORITY_CLASSES, SUCCESS_REASONS
from monitor.store import MonitorStore

PREFIX = "bucketserve:"

# histogram key in the totals -> (metric name, help, label name of the second label)
HISTOGRAMS: dict[str, tuple[str, str, str]] = {
    "ttft": ("time_to_first_token_seconds", "Time to first token, seconds.", "priority_class"),
    "itl": (
        "inter_token_latency_seconds",
        "Time between output tokens (each request's TPOT, once per gap), seconds.",
        "priority_class",
    ),
    "e2e": ("e2e_request_latency_seconds", "End-to-end request latency, seconds.", "priority_class"),
    "queue": (
        "request_queue_time_seconds",
        "Time a request waited before prefill, seconds.",
        "priority_class",
    ),
    "kv_transfer": (
        "kv_transfer_latency_seconds",
        "Time to move a request's KV blocks from prefill to decode, seconds.",
        "priority_class",
    ),
    "batch_size": ("batch_size", "Requests per executed batch (before padding).", "role"),
    "stage": (
        "request_stage_seconds",
        "Time a request spent in each stage of its way through the cluster (admission, controller_queue, "
        "prefill_queue, prefill_forward, first_token_out: the time to first token; kv_transfer, decode_join: "
        "the hand-off to decode; overhead: the time to first token less the prefill forward), seconds.",
        "stage",
    ),
}

# Every family name this module can emit (without the _total/_bucket suffixes); the
# Grafana dashboard test checks its queries against this list.
METRIC_NAMES: tuple[str, ...] = tuple(PREFIX + name for name, _, _ in HISTOGRAMS.values()) + tuple(
    PREFIX + n
    for n in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "free_device_memory_bytes",
        "worker_up",
        "runtime_compilations",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "request_failure",
        "request_slo_met",
        "kv_transfer_bytes",
        "scaling_events",
        "lent_prompt_batches",
        "lent_prompts",
        "lent_core_batches",
        "slo_attainment_ratio",
        "bucket_count",
        "bucket_queue_depth",
        "padding_waste_ratio",
    )
)


def _histograms(totals: dict[str, float], model_name: str) -> Iterable[Metric]:
    decoded = accounting.decode_histograms(totals)
    for key, (name, doc, label) in HISTOGRAMS.items():
        family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name", label])
        for (hist, label_value), h in sorted(decoded.items()):
            if hist != key:
                continue
            cumulative, buckets = 0.0, []
            for bound, count in zip(h.bounds, h.counts, strict=False):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            buckets.append(("+Inf", cumulative + h.counts[-1]))
            family.add_metric([model_name, label_value], buckets, h.total)
        yield family


def _worker_families(store: MonitorStore, model_name: str) -> Iterable[Metric]:
    labels = ["model_name", "worker_id", "role"]
    running = GaugeMetricFamily(
        PREFIX + "num_requests_running", "Requests in the worker's running batch.", labels=labels
    )
    waiting = GaugeMetricFamily(
        PREFIX + "num_requests_waiting", "Requests queued at the worker.", labels=labels
    )
    usage = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "KV-cache usage, 1 = full.", labels=labels)
    memory = GaugeMetricFamily(
        PREFIX + "free_device_memory_bytes", "Free device memory, bytes.", labels=labels
    )
    up = GaugeMetricFamily(PREFIX + "worker_up", "1 while the worker's heartbeat is fresh.", labels=labels)
    compiles = CounterMetricFamily(
        PREFIX + "runtime_compilations",
        "Shapes compiled while serving (a batch outside every warmed bucket).",
        labels=labels,
    )
    for status in store.workers():
        s = status.stats
        values = [model_name, s.worker_id, s.role]
        up.add_metric(values, 1.0 if status.up else 0.0)
        compiles.add_metric(values, s.runtime_compilations)
        # A down worker's last gauges would be stale figures presented as current.
        if status.up:
            running.add_metric(values, s.running)
            waiting.add_metric(values, s.queue_len)
            usage.add_metric(values, s.kv_usage)
            memory.add_metric(values, s.free_memory_bytes)
    return [running, waiting, usage, memory, up, compiles]


def _request_families(totals: dict[str, float], model_name: str) -> Iterable[Metric]:
    labels = ["model_name", "priority_class"]
    prompt = CounterMetricFamily(PREFIX + "prompt_tokens", "Prompt tokens processed.", labels=labels)
    generation = CounterMetricFamily(PREFIX + "generation_tokens", "Tokens generated.", labels=labels)
    met = CounterMetricFamily(
        PREFIX + "request_slo_met", "Finished requests that met their SLOs.", labels=labels
    )
    success = CounterMetricFamily(
        PREFIX + "request_success",
        "Requests finished on a stop condition or max tokens.",
        labels=[*labels, "finished_reason"],
    )
    failure = CounterMetricFamily(
        PREFIX + "request_failure", "Requests aborted or failed.", labels=[*labels, "finished_reason"]
    )
    for cls in PRIORITY_CLASSES:
        prompt.add_metric([model_name, cls], totals.get(f"ptok|{cls}", 0.0))
        generation.add_metric([model_name, cls], totals.get(f"otok|{cls}", 0.0))
        met.add_metric([model_name, cls], totals.get(f"slo|{cls}", 0.0))
        for reason in FINISH_REASONS:
            family = success if reason in SUCCESS_REASONS else failure
            family.add_metric([model_name, cls, reason], totals.get(f"req|{cls}|{reason}", 0.0))
    kv_bytes = CounterMetricFamily(
        PREFIX + "kv_transfer_bytes",
        "KV-cache bytes moved from prefill to decode, by the way they went (shm, grpc, grpc+tls).",
        labels=["model_name", "transport"],
    )
    for key, value in sorted(totals.items()):
        if key.startswith("kvbytes|"):
            kv_bytes.add_metric([model_name, key.split("|", 1)[1]], value)
    scaling = CounterMetricFamily(
        PREFIX + "scaling_events",
        "Workers the autoscaler added (up) or began draining (down).",
        labels=["model_name", "role", "direction"],
    )
    for role in ("prefill", "decode"):
        for direction in ("up", "down"):
            scaling.add_metric([model_name, role, direction], totals.get(f"scale|{role}|{direction}", 0.0))
    lent = CounterMetricFamily(
        PREFIX + "lent_prompt_batches",
        "Prompt batches a decode worker prefilled itself (elastic prefill: the prefill workers were busy).",
        labels=["model_name", "worker"],
    )
    lent_prompts = CounterMetricFamily(
        PREFIX + "lent_prompts",
        "Prompts a decode worker prefilled itself (elastic prefill).",
        labels=["model_name", "worker"],
    )
    lent_cores = CounterMetricFamily(
        PREFIX + "lent_core_batches",
        "Prefill batches that ran on a decode worker's cores too: an idle one's, or a busy one's paused for a prompt that needed them (elastic prefill, serve --share-cores on); colocated: steps of a neighbour that ran on this worker's cores too.",
        labels=["model_name", "worker"],
    )
    for worker, counts in sorted(accounting.decode_lent(totals).items()):
        lent.add_metric([model_name, worker], counts["batches"])
        lent_prompts.add_metric([model_name, worker], counts["prompts"])
        lent_cores.add_metric([model_name, worker], counts["core_batches"])
    return [prompt, generation, success, failure, met, kv_bytes, scaling, lent, lent_prompts, lent_cores]


def _window_families(store: MonitorStore, model_name: str, window_s: float) -> Iterable[Metric]:
    now = store.clock()
    by_class = accounting.aggregate(store.series(10, now - window_s, now))
    ratio = GaugeMetricFamily(
        PREFIX + "slo_attainment_ratio",
        f"Share of requests finished in the last {window_s:g} s that met their SLOs.",
        labels=["model_name", "priority_class"],
    )
    for cls in PRIORITY_CLASSES:
        c = by_class[cls]
        # No requests means no ratio: emitting 0 or 1 would be an invented figure.
        if c.requests:
            ratio.add_metric([model_name, cls], c.slo_met / c.requests)
    return [ratio]


def _bucket_families(store: MonitorStore, totals: dict[str, float], model_name: str) -> Iterable[Metric]:
    count = GaugeMetricFamily(
        PREFIX + "bucket_count", "Current number of request buckets.", labels=["model_name"]
    )
    depth = GaugeMetricFamily(
        PREFIX + "bucket_queue_depth",
        "Requests queued per request bucket [low, high) in tokens.",
        labels=["model_name", "bucket", "bucket_low", "bucket_high"],
    )
    state = store.buckets()
    if state is not None:
        count.add_metric([model_name], len(state.queue_depths))
        for label, lo, hi, d in zip(
            state.labels, state.boundaries, state.boundaries[1:], state.queue_depths, strict=False
        ):
            depth.add_metric([model_name, label, str(lo), str(hi)], d)
    waste = GaugeMetricFamily(
        PREFIX + "padding_waste_ratio",
        "Share of computed tokens that were padding to a warmed shape, since start.",
        labels=["model_name", "role"],
    )
    for name in sorted(totals):
        kind, _, rest = name.partition("|")
        if kind == "pad" and rest.endswith("|padded"):
            role = rest.split("|")[0]
            padded = totals[name]
            if padded > 0:
                waste.add_metric([model_name, role], 1.0 - totals.get(f"pad|{role}|real", 0.0) / padded)
    return [count, depth, waste]


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def collect(store: MonitorStore, model_name: str, window_s: float = 60.0) -> list[Metric]:
    """All metric families for the store's current state."""
    totals = store.totals()
    return [
        *_histograms(totals, model_name),
        *_worker_families(store, model_name),
        *_request_families(totals, model_name),
        *_window_families(store, model_name, window_s),
        *_bucket_families(store, totals, model_name),
    ]


def render(store: MonitorStore, model_name: str, window_s: float = 60.0) -> str:
    """Prometheus text format (version 0.0.4) for `GET /metrics`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(collect(store, model_name, window_s)))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
