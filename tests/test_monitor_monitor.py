"""Monitor: controller summary, dashboard data, invariant check, config and record validation."""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
import uuid

import pytest
from monitor_helpers import T0, FakeClock, request, worker
from redis_fixture import redis_server  # noqa: F401 - pytest fixture

from monitor.config import MonitorConfig
from monitor.monitor import Monitor
from monitor.records import BatchRecord, BucketState, RequestRecord, WorkerStats


def test_summary_feeds_the_controller() -> None:
    clock = FakeClock(T0 + 55)
    mon = Monitor(MonitorConfig(rate_window_s=60.0, heartbeat_ttl_s=10.0), clock=clock)
    mon.report_worker(worker("decode-0", kv_blocks_used=30, kv_blocks_free=70, queue_len=1))
    mon.report_worker(worker("decode-1", kv_blocks_used=0, kv_blocks_free=100, queue_len=0))
    clock.advance(15)  # both lapse; only decode-0 reports again
    mon.report_worker(worker("decode-0", kv_blocks_used=40, kv_blocks_free=60, queue_len=2))
    for i in range(14):  # 14 arrivals of 100 + 200 alternately over the last minute
        mon.record_arrival("online" if i % 2 else "offline", 100 if i % 2 else 200, timestamp=clock.t - 4 * i)
    mon.record_request(request("a", arrival=clock.t - 3, prompt_tokens=90, output_tokens=10, e2e_s=1.0))
    mon.record_request(
        request("b", arrival=clock.t - 3, prompt_tokens=190, output_tokens=10, slo_met=False, e2e_s=1.0)
    )
    mon.set_buckets([0, 512, 2048], [3, 1])

    s = mon.summary()
    json.dumps(s)  # JSON-able as it is
    assert s["free_kv_blocks"] == {"decode-0": 60}, "a down worker is no placement candidate"
    assert s["queue_lengths"] == {"decode-0": 2}
    assert s["workers"]["decode-1"]["up"] is False
    # The window starts at the slot holding now - 60 s: 14 arrivals over (now - slot start) seconds.
    span = clock.t - (int((clock.t - 60) // 10) * 10)
    assert math.isclose(s["arrival_rate_rps"], 14 / span)
    assert math.isclose(s["completion_rate_rps"], 2 / span)
    assert s["mean_prompt_tokens"] == 150
    assert s["mean_seq_tokens"] == 150
    assert s["slo_attainment"] == {"online": 0.5, "offline": None}
    assert s["buckets"]["boundaries"] == [0, 512, 2048] and s["buckets"]["queue_depths"] == [3, 1]


def test_summary_when_idle() -> None:
    s = Monitor(clock=FakeClock()).summary()
    assert s["arrival_rate_rps"] == 0 and s["mean_prompt_tokens"] is None and s["buckets"] is None
    assert s["workers"] == {} and s["free_kv_blocks"] == {}


def test_dashboard_data() -> None:
    clock = FakeClock(T0)
    mon = Monitor(clock=clock)
    for minute in range(3):
        mon.report_worker(
            worker("decode-0", kv_blocks_used=10 * (minute + 1), kv_blocks_free=100 - 10 * (minute + 1))
        )
        mon.set_buckets([0, 128, 1024], [minute, 1])
        for i in range(10):
            ok = i < 10 - 3 * minute  # attainment falls: 100%, 70%, 40%
            mon.record_request(
                request(f"m{minute}-{i}", arrival=clock.t, e2e_s=1.0, slo_met=ok, ttft_s=0.01 * (i + 1))
            )
        mon.record_request(request(f"off{minute}", arrival=clock.t, priority_class="offline", e2e_s=1.0))
        clock.advance(60)

    d = mon.dashboard_data(window_s=300)
    json.dumps(d)
    assert d["resolution_s"] == 10 and len(d["t"]) == 31
    n = len(d["t"])
    for key in ("slo_attainment", "goodput_rps", "request_rate_rps"):
        assert set(d[key]) == {"online", "offline"} and all(len(v) == n for v in d[key].values())
    online = [v for v in d["slo_attainment"]["online"] if v is not None]
    assert online == [1.0, 0.7, 0.4]
    assert [v for v in d["goodput_rps"]["online"] if v] == [1.0, 0.7, 0.4]
    assert [v for v in d["request_rate_rps"]["offline"] if v] == [0.1, 0.1, 0.1]
    # Each minute's TTFTs (ms): online 10, 20, ..., 100 and one offline 80. Lower-rank
    # quantiles of those 11 values: p50 is the 6th (60), p99 the 10th (90).
    for name, expected in (("p50", 60.0), ("p99", 90.0)):
        got = [v for v in d["ttft_ms"][name] if v is not None]
        assert len(got) == 3 and all(math.isclose(v, expected, rel_tol=0.02) for v in got), (name, got)
    assert [v for v in d["worker_kv_usage"]["decode-0"] if v is not None] == [0.1, 0.2, 0.3]
    assert [v for v in d["queue_depth"] if v is not None] == [1, 2, 3]
    assert d["buckets"]["labels"] == ["0-128", "128-1024"]
    assert d["workers"][0]["worker_id"] == "decode-0" and d["workers"][0]["up"] is False
    assert math.isclose(d["window_totals"]["online"]["slo_attainment"], 21 / 30)

    hour = mon.dashboard_data(window_s=6 * 3600)
    assert hour["resolution_s"] == 60
    assert [v for v in hour["slo_attainment"]["online"] if v is not None] == [1.0, 0.7, 0.4]


def test_check_reports_breaches() -> None:
    clock = FakeClock()
    mon = Monitor(MonitorConfig(heartbeat_ttl_s=5.0), clock=clock)
    mon.report_worker(worker("ok", running=0, queue_len=0, kv_blocks_used=0, kv_blocks_free=100))
    mon.report_worker(worker("busy", running=3, queue_len=0, kv_blocks_used=20, kv_blocks_free=70))
    assert mon.check() == [], "blocks in flight on a busy worker are no leak"
    mon.report_worker(worker("leaky", running=0, queue_len=0, kv_blocks_used=0, kv_blocks_free=98))
    mon.report_worker(worker("compiler", runtime_compilations=1))
    problems = mon.check()
    assert any("leaky" in p and "leaks KV blocks" in p for p in problems), problems
    assert any("compiler" in p and "compiled 1" in p for p in problems), problems
    clock.advance(6)
    mon.report_worker(worker("ok", running=0, queue_len=0, kv_blocks_used=0, kv_blocks_free=100))
    assert sum("is down" in p for p in mon.check()) == 3


def test_monitor_on_redis_restart(redis_server: str) -> None:  # noqa: F811
    config = MonitorConfig(store="redis", redis_url=redis_server, key_prefix=f"mon-{uuid.uuid4().hex[:8]}")
    clock = FakeClock(T0 + 30)
    first = Monitor(config, clock=clock)
    first.report_worker(worker("decode-0"))
    first.record_request(request("a", arrival=T0))
    first.record_batch(BatchRecord("decode-0", "decode", 2, 2, 4, T0))
    first.set_buckets([0, 64], [7])
    before = (first.dashboard_data(600), first.metrics_text("m"))
    first.close()
    second = Monitor(config, clock=clock)
    assert (second.dashboard_data(600), second.metrics_text("m")) == before
    second.close()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"store": "disk"}, "store"),
        ({"store": "redis"}, "redis_url"),
        ({"store": "redis", "redis_url": "http://x"}, "redis_url"),
        ({"redis_url": "redis://x"}, "redis_url"),
        ({"heartbeat_ttl_s": 0}, "heartbeat_ttl_s"),
        ({"retention_s": 30}, "retention_s"),
        ({"retention_s": float("nan")}, "retention_s"),
        ({"max_requests": 0}, "max_requests"),
        ({"rate_window_s": -1}, "rate_window_s"),
        ({"key_prefix": "a b"}, "key_prefix"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"MonitorConfig\.{field}"):
        MonitorConfig(**kwargs)


def test_config_for_url() -> None:
    assert MonitorConfig.for_url(None).store == "memory"
    c = MonitorConfig.for_url("redis://h:6379/0", retention_s=3600.0)
    assert (c.store, c.redis_url, c.retention_s) == ("redis", "redis://h:6379/0", 3600.0)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: worker(role="router"), "WorkerStats.role"),
        (lambda: worker(kv_blocks_used=90, kv_blocks_free=20), "WorkerStats.kv_blocks_used"),
        (lambda: worker(queue_len=-1), "WorkerStats.queue_len"),
        (lambda: worker(warmed=1), "WorkerStats.warmed"),
        (lambda: request("x", priority_class="batch"), "RequestRecord.priority_class"),
        (lambda: request("x", finish_reason="error", slo_met=True), "RequestRecord.slo_met"),
        (lambda: request("x", ttft_s=float("nan")), "RequestRecord.ttft_s"),
        (lambda: request("x", bucket=(128, 0)), "RequestRecord.bucket"),
        (lambda: request(""), "RequestRecord.request_id"),
        (lambda: BatchRecord("w", "decode", 2, 10, 5, T0), "BatchRecord.padded_tokens"),
        (lambda: BucketState((0, 10, 5), (1, 1), T0), "BucketState.boundaries"),
        (lambda: BucketState((0, 10), (1, 1), T0), "BucketState.queue_depths"),
    ],
)
def test_record_errors_name_the_field(build: object, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build()  # type: ignore[operator]


def test_records_pickle_and_json_round_trip() -> None:
    for rec in (worker(), request("r", bucket=(0, 128)), BatchRecord("w", "decode", 2, 3, 4, T0)):
        assert pickle.loads(pickle.dumps(rec)) == rec
        assert type(rec).from_dict(json.loads(json.dumps(rec.to_dict()))) == rec
    assert RequestRecord.from_dict({**request("r").to_dict(), "added_later": 1}) == request("r")
    assert WorkerStats.from_dict(worker().to_dict()).kv_usage == 0.25


def test_monitor_imports_nothing_else_of_ours() -> None:
    code = (
        "import sys, monitor, monitor.metrics, monitor.redis_store, monitor.dashboard; "
        "ours = {'engine', 'gateway', 'prefill_worker', 'decode_worker', 'kv_transfer', 'bucket_manager', 'proto', 'bench'}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ours))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
