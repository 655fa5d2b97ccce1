"""Prometheus exposition: parsed back with prometheus_client's own parser."""

from __future__ import annotations

import math
import uuid

import pytest
from monitor_helpers import T0, FakeClock, request, worker
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from redis_fixture import redis_server  # noqa: F401 - pytest fixture

from monitor import metrics
from monitor.config import MonitorConfig
from monitor.monitor import Monitor
from monitor.records import BatchRecord


def _feed(mon: Monitor, clock: FakeClock) -> None:
    mon.report_worker(worker("decode-0", kv_blocks_used=25, kv_blocks_free=75, running=2, queue_len=3))
    mon.report_worker(
        worker("prefill-0", role="prefill", runtime_compilations=2, kv_blocks_used=0, kv_blocks_free=100)
    )
    mon.report_worker(worker("decode-1", kv_blocks_used=10, kv_blocks_free=90))
    clock.advance(20)  # decode-1 and the others lapse ...
    mon.report_worker(worker("decode-0", kv_blocks_used=25, kv_blocks_free=75, running=2, queue_len=3))
    mon.report_worker(
        worker("prefill-0", role="prefill", runtime_compilations=2, kv_blocks_used=0, kv_blocks_free=100)
    )
    # ... but only decode-1 stays silent.
    t = clock.t
    for i, ttft in enumerate((0.05, 0.07, 0.5)):
        mon.record_request(
            request(f"on{i}", arrival=t - 5, ttft_s=ttft, slo_met=ttft < 0.1, output_tokens=11)
        )
    mon.record_request(
        request(
            "off0", arrival=t - 5, priority_class="offline", prompt_tokens=1000, output_tokens=64, tpot_s=0.02
        )
    )
    mon.record_request(
        request(
            "off1",
            arrival=t - 5,
            priority_class="offline",
            finish_reason="error",
            slo_met=False,
            error="boom",
            ttft_s=None,
            tpot_s=None,
            output_tokens=0,
        )
    )
    # KV transfers come from the prefill workers, one per acknowledged transfer (not from request records).
    for _ in range(4):
        mon.record_transfer("online", 4096, 0.002, "grpc")
    mon.record_transfer("online", 1024, 0.001, "shm")
    mon.record_batch(
        BatchRecord("prefill-0", "prefill", batch_size=3, real_tokens=300, padded_tokens=512, timestamp=t)
    )
    mon.set_buckets([0, 256, 1024, 4096], [5, 2, 0])


def _parse(text: str) -> dict[str, list[Sample]]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture
def text() -> str:
    clock = FakeClock()
    mon = Monitor(MonitorConfig(heartbeat_ttl_s=10.0), clock=clock)
    _feed(mon, clock)
    return mon.metrics_text("tiny-llama")


def test_every_family_is_exposed_with_model_name(text: str) -> None:
    families = _parse(text)
    assert set(metrics.METRIC_NAMES) <= set(families), set(metrics.METRIC_NAMES) - set(families)
    for name, samples in families.items():
        assert name.startswith("bucketserve:"), name
        for s in samples:
            assert s.labels.get("model_name") == "tiny-llama", s


def test_histograms(text: str) -> None:
    f = _parse(text)
    ttft = f["bucketserve:time_to_first_token_seconds"]
    name = "bucketserve:time_to_first_token_seconds"
    assert _value(ttft, name + "_count", priority_class="online") == 3
    assert math.isclose(_value(ttft, name + "_sum", priority_class="online"), 0.62)
    assert _value(ttft, name + "_bucket", priority_class="online", le="0.06") == 1
    assert _value(ttft, name + "_bucket", priority_class="online", le="0.08") == 2
    assert _value(ttft, name + "_bucket", priority_class="online", le="+Inf") == 3
    itl = f["bucketserve:inter_token_latency_seconds"]
    # 3 online requests x 10 gaps, 1 offline request x 63 gaps
    assert _value(itl, "bucketserve:inter_token_latency_seconds_count", priority_class="online") == 30
    assert _value(itl, "bucketserve:inter_token_latency_seconds_count", priority_class="offline") == 63
    batch = f["bucketserve:batch_size"]
    assert _value(batch, "bucketserve:batch_size_bucket", role="prefill", le="2.0") == 0
    assert _value(batch, "bucketserve:batch_size_bucket", role="prefill", le="4.0") == 1


def test_counters_and_gauges(text: str) -> None:
    f = _parse(text)
    assert (
        _value(f["bucketserve:prompt_tokens"], "bucketserve:prompt_tokens_total", priority_class="offline")
        == 1100
    )
    assert (
        _value(
            f["bucketserve:generation_tokens"], "bucketserve:generation_tokens_total", priority_class="online"
        )
        == 33
    )
    success = f["bucketserve:request_success"]
    assert (
        _value(
            success, "bucketserve:request_success_total", priority_class="online", finished_reason="length"
        )
        == 3
    )
    failure = f["bucketserve:request_failure"]
    assert (
        _value(
            failure, "bucketserve:request_failure_total", priority_class="offline", finished_reason="error"
        )
        == 1
    )
    kv = f["bucketserve:kv_transfer_bytes"]
    assert _value(kv, "bucketserve:kv_transfer_bytes_total", transport="grpc") == 4 * 4096
    assert _value(kv, "bucketserve:kv_transfer_bytes_total", transport="shm") == 1024

    slo = f["bucketserve:slo_attainment_ratio"]
    assert math.isclose(_value(slo, "bucketserve:slo_attainment_ratio", priority_class="online"), 2 / 3)
    assert _value(slo, "bucketserve:slo_attainment_ratio", priority_class="offline") == 0.5

    usage = f["bucketserve:kv_cache_usage_perc"]
    assert _value(usage, "bucketserve:kv_cache_usage_perc", worker_id="decode-0") == 0.25
    assert not [s for s in usage if s.labels["worker_id"] == "decode-1"], "a down worker has no live gauges"
    up = f["bucketserve:worker_up"]
    assert _value(up, "bucketserve:worker_up", worker_id="decode-1") == 0
    assert _value(up, "bucketserve:worker_up", worker_id="decode-0") == 1
    assert (
        _value(
            f["bucketserve:num_requests_waiting"], "bucketserve:num_requests_waiting", worker_id="decode-0"
        )
        == 3
    )
    compiles = f["bucketserve:runtime_compilations"]
    assert _value(compiles, "bucketserve:runtime_compilations_total", worker_id="prefill-0") == 2

    assert _value(f["bucketserve:bucket_count"], "bucketserve:bucket_count") == 3
    depth = f["bucketserve:bucket_queue_depth"]
    assert (
        _value(depth, "bucketserve:bucket_queue_depth", bucket="0-256", bucket_low="0", bucket_high="256")
        == 5
    )
    assert _value(depth, "bucketserve:bucket_queue_depth", bucket="256-1024") == 2
    waste = f["bucketserve:padding_waste_ratio"]
    assert math.isclose(_value(waste, "bucketserve:padding_waste_ratio", role="prefill"), 1 - 300 / 512)


def test_empty_monitor_renders_without_invented_figures() -> None:
    f = _parse(Monitor(clock=FakeClock()).metrics_text("m"))
    assert f["bucketserve:slo_attainment_ratio"] == [], "no requests, no ratio"
    assert f["bucketserve:bucket_count"] == []
    assert (
        _value(f["bucketserve:prompt_tokens"], "bucketserve:prompt_tokens_total", priority_class="online")
        == 0
    )


def test_redis_and_memory_expose_the_same_text(redis_server: str) -> None:  # noqa: F811
    texts = []
    for config in (
        MonitorConfig(),
        MonitorConfig(store="redis", redis_url=redis_server, key_prefix=f"m-{uuid.uuid4().hex[:8]}"),
    ):
        clock = FakeClock(T0)
        mon = Monitor(config, clock=clock)
        _feed(mon, clock)
        texts.append(mon.metrics_text("tiny-llama"))
        mon.close()
    # Redis adds floats in long double, so sums may differ in the last bit: compare values.
    mem, red = ([(s.name, s.labels, s.value) for f in _parse(t).values() for s in f] for t in texts)
    assert [(n, lab) for n, lab, _ in mem] == [(n, lab) for n, lab, _ in red]
    for (name, labels, a), (_, _, b) in zip(mem, red, strict=True):
        assert math.isclose(a, b, rel_tol=1e-12), (name, labels, a, b)
