"""One contract for every MonitorStore backend, plus what only Redis promises (sharing, restart)."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from monitor_helpers import T0, FakeClock, request, worker
from redis_fixture import redis_server  # noqa: F401 - pytest fixture

from monitor import sketch
from monitor.config import MonitorConfig
from monitor.memory_store import MemoryStore
from monitor.records import BatchRecord, BucketState
from monitor.store import MonitorStore
from monitor.stores import create_store

MakeStore = Callable[..., MonitorStore]


@pytest.fixture(params=["memory", "redis"])
def make_store(request: pytest.FixtureRequest) -> Any:
    """make_store(clock, **config) -> a store; with Redis, every store of one test shares a prefix."""
    made: list[MonitorStore] = []
    prefix = f"test-{uuid.uuid4().hex[:12]}"

    def make(clock: Callable[[], float], **overrides: Any) -> MonitorStore:
        if request.param == "redis":
            url = request.getfixturevalue("redis_server")
            config = MonitorConfig(store="redis", redis_url=url, key_prefix=prefix, **overrides)
        else:
            config = MonitorConfig(**overrides)
        store = create_store(config, clock=clock)
        made.append(store)
        return store

    make.kind = request.param  # type: ignore[attr-defined]
    yield make
    for store in made:
        store.close()


def test_registry_picks_backend(make_store: Any) -> None:
    store = make_store(FakeClock())
    if make_store.kind == "memory":
        assert type(store).__name__ == "MemoryStore"
    else:
        # Redis, with memory to answer from through an outage.
        assert (type(store).__name__, type(store.primary).__name__) == ("FallbackStore", "RedisStore")


def test_worker_heartbeat_ttl(make_store: Any) -> None:
    clock = FakeClock()
    store = make_store(clock, heartbeat_ttl_s=5.0, retention_s=600.0)
    store.put_worker(worker("decode-0", queue_len=4))
    store.put_worker(worker("prefill-0", role="prefill"))
    [d, p] = store.workers()  # sorted by id
    assert (d.stats.worker_id, d.up, d.stats.queue_len) == ("decode-0", True, 4)
    assert p.stats.role == "prefill" and p.up

    clock.advance(4.0)
    store.put_worker(worker("prefill-0", role="prefill", queue_len=9))
    clock.advance(2.0)  # decode-0 is now 6 s silent, prefill-0 only 2 s
    status = {s.stats.worker_id: s for s in store.workers()}
    assert not status["decode-0"].up, "a lapsed heartbeat must show as down"
    assert status["decode-0"].stats.queue_len == 4, "a down worker keeps its last stats"
    assert status["prefill-0"].up and status["prefill-0"].stats.queue_len == 9
    assert status["decode-0"].last_seen == T0

    store.put_worker(worker("decode-0"))
    assert all(s.up for s in store.workers())

    store.forget_worker("decode-0")
    assert [s.stats.worker_id for s in store.workers()] == ["prefill-0"]
    clock.advance(601.0)  # past retention: the silent worker is dropped altogether
    assert store.workers() == []


def test_request_records_round_trip_and_dedupe(make_store: Any) -> None:
    clock = FakeClock()
    store = make_store(clock)
    recs = [
        request(f"r{i}", arrival=T0 - 5 + i, priority_class="offline" if i % 2 else "online")
        for i in range(4)
    ]
    for rec in recs:
        assert store.add_request(rec) is True
    assert store.get_request("r2") == recs[2]
    assert store.get_request("missing") is None
    assert [r.request_id for r in store.recent_requests(3)] == ["r3", "r2", "r1"]

    before = store.totals()
    assert store.add_request(recs[0]) is False, "a repeated id is ignored"
    assert store.totals() == before, "a repeated report must not count twice"


def test_request_records_are_capped(make_store: Any) -> None:
    clock = FakeClock()
    store = make_store(clock, max_requests=5)
    for i in range(8):
        store.add_request(request(f"r{i}"))
    assert [r.request_id for r in store.recent_requests(100)] == ["r7", "r6", "r5", "r4", "r3"]
    assert store.get_request("r0") is None, "records beyond max_requests are dropped"
    # The totals still count every request: the cap bounds memory, not accounting.
    assert store.totals()["req|online|length"] == 8


def test_series_rollup(make_store: Any) -> None:
    clock = FakeClock(T0 + 59)
    store = make_store(clock)
    # Slot [T0, T0+10): two online (one missed its SLO) and one failed offline.
    store.add_request(request("a", arrival=T0 + 1, e2e_s=1.0, ttft_s=0.1, output_tokens=5))
    store.add_request(request("b", arrival=T0 + 2, e2e_s=1.0, ttft_s=0.3, slo_met=False, output_tokens=7))
    store.add_request(
        request(
            "c",
            arrival=T0 + 3,
            priority_class="offline",
            finish_reason="error",
            slo_met=False,
            error="decode worker lost",
            ttft_s=None,
            tpot_s=None,
            e2e_s=None,
            output_tokens=0,
        )
    )
    # Slot [T0+20, T0+30): one online.
    store.add_request(request("d", arrival=T0 + 21, e2e_s=2.0, prompt_tokens=300))

    fine = store.series(10, T0, T0 + 59)
    assert [s.start for s in fine] == [int(T0) + 10 * i for i in range(6)]
    on, off = fine[0].classes["online"], fine[0].classes["offline"]
    assert (on.requests, on.slo_met, on.errors, on.output_tokens, on.good_tokens) == (2, 1, 0, 12, 5)
    assert (off.requests, off.slo_met, off.errors) == (1, 0, 1)
    assert fine[1].total().requests == 0, "an empty slot is there, with zeros"
    assert fine[2].classes["online"].prompt_tokens == 300
    ttft = sketch.quantile(on.ttft_bins, 1.0)
    assert ttft is not None and math.isclose(ttft, 300.0, rel_tol=sketch.RELATIVE_ACCURACY)

    [minute] = store.series(60, T0, T0 + 59)
    assert minute.start == int(T0)
    assert minute.classes["online"].requests == 3 and minute.classes["online"].slo_met == 2
    assert minute.total().requests == 4


def test_series_percentiles_within_sketch_accuracy(make_store: Any) -> None:
    clock = FakeClock(T0 + 9)
    store = make_store(clock)
    values_ms = [1.0 + i * 0.997 for i in range(500)]  # 1 ms .. ~500 ms, not on bin edges
    for i, v in enumerate(values_ms):
        store.add_request(request(f"p{i}", arrival=T0, e2e_s=0.0, ttft_s=v / 1000.0, tpot_s=v / 2000.0))
    [slot] = store.series(10, T0, T0)
    bins = slot.classes["online"].ttft_bins
    assert len(bins) <= sketch.MAX_BINS
    for q in (0.5, 0.9, 0.99):
        exact = values_ms[int(q * (len(values_ms) - 1))]
        got = sketch.quantile(bins, q)
        assert got is not None and abs(got - exact) <= sketch.RELATIVE_ACCURACY * exact + 1e-9, (
            q,
            got,
            exact,
        )
    tpot = sketch.quantile(slot.classes["online"].tpot_bins, 0.5)
    assert tpot is not None and math.isclose(tpot, values_ms[249] / 2, rel_tol=sketch.RELATIVE_ACCURACY)


def test_series_retention_window(make_store: Any) -> None:
    clock = FakeClock()
    store = make_store(clock, retention_s=120.0)
    store.add_request(request("old", arrival=T0))
    clock.advance(200.0)
    store.add_request(request("new", arrival=clock.t))
    # A record that finished before the window only reaches the totals.
    store.add_request(request("stale", arrival=clock.t - 500))
    window = store.series(10, T0 - 1000, clock.t)
    assert window[0].start >= clock.t - 120 - 10, "nothing older than retention is returned"
    assert sum(s.total().requests for s in window) == 1
    assert store.totals()["req|online|length"] == 3


def test_arrivals(make_store: Any) -> None:
    clock = FakeClock(T0 + 5)
    store = make_store(clock)
    store.add_arrival("online", 100)
    store.add_arrival("online", 300, timestamp=T0 + 1)
    store.add_arrival("offline", 50)
    [slot] = store.series(10, T0, T0)
    assert slot.classes["online"].arrivals == 2 and slot.classes["online"].arrival_tokens == 400
    assert slot.classes["offline"].arrivals == 1
    with pytest.raises(ValueError, match="priority_class"):
        store.add_arrival("batch", 1)


def test_bucket_state(make_store: Any) -> None:
    clock = FakeClock(T0 + 1)
    store = make_store(clock)
    assert store.buckets() is None
    state = BucketState(boundaries=(0, 128, 512, 2048), queue_depths=(4, 0, 2), timestamp=T0)
    store.set_buckets(state)
    assert store.buckets() == state
    assert store.buckets().labels == ["0-128", "128-512", "512-2048"]  # type: ignore[union-attr]
    clock.advance(1)
    store.set_buckets(BucketState(boundaries=(0, 2048), queue_depths=(1,), timestamp=T0 + 2))
    [slot] = store.series(10, T0, T0)
    assert (slot.queue_depth, slot.bucket_count) == (1, 1), "the slot keeps the last pushed state"


def test_totals_histograms_and_batches(make_store: Any) -> None:
    store = make_store(FakeClock())
    store.add_request(request("a", ttft_s=0.07, output_tokens=11, tpot_s=0.01))
    store.add_batch(
        BatchRecord("prefill-0", "prefill", batch_size=3, real_tokens=300, padded_tokens=512, timestamp=T0)
    )
    t = store.totals()
    # 0.07 s falls in the (0.06, 0.08] bucket, index 6 of the TTFT bounds.
    assert t["h|ttft|online|6"] == 1 and t["hc|ttft|online"] == 1
    assert math.isclose(t["hs|ttft|online"], 0.07)
    assert t["hc|itl|online"] == 10, "TPOT counts once per gap between output tokens"
    assert t["h|batch_size|prefill|2"] == 1  # 3 -> le=4
    assert (t["pad|prefill|real"], t["pad|prefill|padded"]) == (300, 512)
    # KV bytes come only from the prefill workers' transfer reports, not from request records.
    assert not any(k.startswith("kvbytes") for k in t) and "hc|kv_transfer|online" not in t
    # Prometheus buckets are "less than or equal": 0.1 s exactly belongs to le="0.1" (index 7).
    store.add_request(request("edge", ttft_s=0.1))
    assert store.totals()["h|ttft|online|7"] == 1


def test_kv_transfers_reported_by_prefill_workers(make_store: Any) -> None:
    store = make_store(FakeClock())
    store.add_transfer("offline", 1 << 20, 0.004, "grpc+tls")
    store.add_transfer("offline", 1 << 20, 0.006, "grpc+tls")
    store.add_transfer("online", 1 << 10, 0.001, "shm")
    t = store.totals()
    # Bytes by the way they went: the transport is a label of kv_transfer_bytes.
    assert t["kvbytes|grpc+tls"] == 2 << 20 and t["kvbytes|shm"] == 1 << 10
    assert t["hc|kv_transfer|offline"] == 2 and math.isclose(t["hs|kv_transfer|offline"], 0.010)
    with pytest.raises(ValueError, match="transport"):
        store.add_transfer("online", 1, 0.1, "grpc|x")
    with pytest.raises(ValueError, match="priority_class"):
        store.add_transfer("batch", 1, 0.1)
    with pytest.raises(ValueError, match="nbytes"):
        store.add_transfer("online", -1, 0.1)


def test_memory_store_stays_bounded() -> None:
    clock = FakeClock()
    store = MemoryStore(MonitorConfig(retention_s=300.0, max_requests=50), clock=clock)
    for i in range(3000):  # 3000 s of traffic, 10x the retention
        clock.advance(1.0)
        store.add_request(request(f"r{i}", arrival=clock.t, e2e_s=0.0, ttft_s=0.001 * (i % 997 + 1)))
        store.put_worker(worker(f"w{i % 3}"))
    sizes = store.sizes()
    assert sizes["requests"] == 50
    # Slots live retention + res after their last write: (300+10)/10 + (300+60)/60, plus the
    # ones not pruned yet (pruning runs every 10 s) and the totals.
    assert sizes["hashes"] <= 31 + 6 + 2 + 2 + 1, sizes
    assert sizes["workers"] == 3
    # A record that finished before the window creates no slot (it only reaches the totals).
    store.add_request(request("stale", arrival=clock.t - 1000, e2e_s=0.0))
    assert store.sizes()["hashes"] == sizes["hashes"]


def test_redis_stores_share_one_view(redis_server: str) -> None:  # noqa: F811
    clock = FakeClock(T0 + 30)
    prefix = f"share-{uuid.uuid4().hex[:8]}"
    config = MonitorConfig(store="redis", redis_url=redis_server, key_prefix=prefix)
    a, b = create_store(config, clock), create_store(config, clock)
    try:
        a.put_worker(worker("decode-0"))
        b.put_worker(worker("prefill-0", role="prefill"))
        a.add_request(request("x", arrival=T0 + 1))
        b.add_request(request("y", arrival=T0 + 2, priority_class="offline"))
        assert b.add_request(request("x", arrival=T0 + 1)) is False, "ids are deduplicated across replicas"
        for store in (a, b):
            assert [s.stats.worker_id for s in store.workers()] == ["decode-0", "prefill-0"]
            [slot] = store.series(10, T0, T0)
            assert slot.classes["online"].requests == 1 and slot.classes["offline"].requests == 1
    finally:
        a.close()
        b.close()


def test_redis_history_survives_a_restart(redis_server: str) -> None:  # noqa: F811
    clock = FakeClock(T0 + 30)
    config = MonitorConfig(
        store="redis", redis_url=redis_server, key_prefix=f"restart-{uuid.uuid4().hex[:8]}"
    )
    writer = create_store(config, clock)
    writer.put_worker(worker("decode-0", kv_blocks_used=40, kv_blocks_free=60))
    for i in range(20):
        writer.add_request(request(f"h{i}", arrival=T0 + i, slo_met=i % 4 != 0))
    writer.set_buckets(BucketState(boundaries=(0, 256, 1024), queue_depths=(3, 1), timestamp=T0))
    writer.add_batch(
        BatchRecord("decode-0", "decode", batch_size=4, real_tokens=4, padded_tokens=4, timestamp=T0)
    )
    expected = (
        writer.workers(),
        writer.recent_requests(100),
        writer.series(10, T0, T0 + 30),
        writer.totals(),
    )
    writer.close()

    reader = create_store(config, clock)  # a fresh process would build exactly this
    try:
        got = (reader.workers(), reader.recent_requests(100), reader.series(10, T0, T0 + 30), reader.totals())
        assert got == expected
        assert len(got[1]) == 20 and got[0][0].stats.kv_blocks_used == 40
        assert sum(s.classes["online"].slo_met for s in got[2]) == 15
        assert reader.buckets() == BucketState(boundaries=(0, 256, 1024), queue_depths=(3, 1), timestamp=T0)
    finally:
        reader.close()


def test_redis_unreachable_fails_clearly() -> None:
    config = MonitorConfig(store="redis", redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(ConnectionError, match=r"redis://127\.0\.0\.1:1/0"):
        create_store(config)
