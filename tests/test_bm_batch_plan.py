"""Batch planning: memory safety, warmed shapes, priority order, and no starvation (property tests)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bucket_manager.batch_plan import first_request, plan_batch
from bucket_manager.memory_budget import (
    MemoryBudget,
    ModelGeometry,
    WorkerLoad,
    blocks_from_bytes,
    choose_workers,
    n_max,
    safe_blocks,
)
from bucket_manager.priority import PriorityPolicy
from bucket_manager.request import PriorityClass, RequestSummary
from bucket_manager.request_buckets import RequestBuckets
from bucket_manager.shape_buckets import ShapeBucketConfig, ShapeBuckets

ONLINE, OFFLINE = PriorityClass.ONLINE, PriorityClass.OFFLINE
SHAPES = ShapeBuckets(
    ShapeBucketConfig.from_serving(
        block_size=16, max_model_len=1024, max_num_prefill_seqs=8, max_num_batched_tokens=2048, env={}
    )
)


def make_queue(requests, policy: PriorityPolicy) -> RequestBuckets:
    q = RequestBuckets(1024, SHAPES.prompt_query_lens, key=policy.key)
    for r in requests:
        q.add(r)
    return q


def budget(prefill: int = 10_000, decode: int = 10_000, **kw) -> MemoryBudget:
    return MemoryBudget(
        block_size=16,
        prefill_free_blocks=prefill,
        decode_free_blocks=decode,
        max_num_batched_tokens=2048,
        **kw,
    )


def test_eq5_eq6_in_blocks():
    geo = ModelGeometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype_bytes=2)
    assert geo.kv_bytes_per_token == 2 * 4 * 2 * 64 * 2
    assert blocks_from_bytes(geo.kv_bytes_per_token * 16 * 10 + 5, geo, 16) == 10
    assert safe_blocks(100) == 90
    assert n_max([16, 17, 16, 1], budget_blocks=4, block_size=16) == 3  # 1 + 2 + 1 blocks, the next overflows
    with pytest.raises(ValueError, match="head_dim"):
        ModelGeometry(4, 2, 0, 2)
    with pytest.raises(ValueError, match="safety"):
        budget(safety=1.5)


def test_capacity_is_bounded_by_every_limit():
    b = budget(prefill=1000, decode=1000)
    assert b.capacity(100, 10, largest_batch=8) == 8
    assert b.capacity(1000, 1000, largest_batch=64) == min(900 // 63, 900 // 125, 2048 // 1000)
    assert budget(prefill=0).capacity(100, 10, 8) == 1


def test_choose_workers():
    p, d = choose_workers(
        [WorkerLoad("p0", 10, queue_len=3), WorkerLoad("p1", 5, queue_len=1)],
        [WorkerLoad("d0", 100), WorkerLoad("d1", 300, queue_len=9)],
    )
    assert (p.worker_id, d.worker_id) == ("p1", "d1")
    with pytest.raises(ValueError, match="free_blocks"):
        WorkerLoad("x", -1)


def test_online_goes_first_by_arrival_or_deadline():
    reqs = [
        RequestSummary("late-tight", 100, 8, ONLINE, arrival=2.0, ttft_slo_ms=100),
        RequestSummary("early-loose", 900, 8, ONLINE, arrival=1.0, ttft_slo_ms=5000),
        RequestSummary("offline", 50, 8, OFFLINE, arrival=0.0),
    ]
    by_arrival = PriorityPolicy(online_order="arrival", fill_with_other_class=False)
    q = make_queue(reqs, by_arrival)
    q.adjust(1)  # split so lengths land in different buckets
    plan = plan_batch(q, SHAPES, budget(), by_arrival, now=2.05)
    assert plan is not None and plan.request_ids[0] == "early-loose" and plan.priority_class is ONLINE
    by_deadline = PriorityPolicy(online_order="deadline", fill_with_other_class=False)
    q = make_queue(reqs, by_deadline)
    q.adjust(1)
    plan = plan_batch(q, SHAPES, budget(), by_deadline, now=2.05)  # both can still meet their deadlines
    assert plan is not None and plan.request_ids[0] == "late-tight"


def test_online_shortest_first_and_its_aging_guard():
    policy = PriorityPolicy(online_order="sjf", max_online_wait_s=10.0, fill_with_other_class=False)
    reqs = [RequestSummary("long", 900, 8, ONLINE, arrival=0.0)]
    reqs += [RequestSummary(f"s{i}", 20 + i, 8, ONLINE, arrival=1.0 + i) for i in range(8)]
    q = make_queue(reqs, policy)
    q.adjust(4)
    assert q.bucket_index(900) != q.bucket_index(20), "the test needs the long prompt in a bucket of its own"
    # Before the guard: the short prompts go first although the long one arrived first.
    plan = plan_batch(q, SHAPES, budget(), policy, now=9.9)
    assert plan is not None and not plan.by_guard and "long" not in plan.request_ids
    assert plan.request_ids[0] == "s0"
    # Once it has waited max_online_wait_s, the long one goes first.
    plan = plan_batch(q, SHAPES, budget(), policy, now=10.0)
    assert plan is not None and plan.by_guard and plan.request_ids[0] == "long"
    # Arrival order would have served it first from the start.
    by_arrival = PriorityPolicy(online_order="arrival", fill_with_other_class=False)
    q = make_queue(reqs, by_arrival)
    q.adjust(4)
    assert plan_batch(q, SHAPES, budget(), by_arrival, now=0.0).request_ids[0] == "long"


def test_online_requests_that_can_no_longer_meet_their_ttft_go_last():
    # Arrival order, TTFT 500 ms each: at t=1.0 the two oldest are past their deadlines (0.5 and 0.7).
    policy = PriorityPolicy(online_order="arrival", fill_with_other_class=False, short_batch_tokens=0)
    reqs = [
        RequestSummary("old-a", 200, 8, ONLINE, arrival=0.0, ttft_slo_ms=500),
        RequestSummary("old-b", 40, 8, ONLINE, arrival=0.2, ttft_slo_ms=500),
        RequestSummary("new-c", 200, 8, ONLINE, arrival=0.8, ttft_slo_ms=500),
        RequestSummary("new-d", 40, 8, ONLINE, arrival=0.9, ttft_slo_ms=500),
        RequestSummary("no-slo", 40, 8, ONLINE, arrival=0.1),  # never late: no TTFT target
    ]
    q = make_queue(reqs, policy)
    plan = plan_batch(q, SHAPES, budget(), policy, now=1.0)
    assert plan is not None and not plan.by_guard
    # On-time requests by arrival, then the late ones by arrival (one bucket: nothing split yet).
    assert plan.request_ids == ("no-slo", "new-c", "new-d", "old-a", "old-b")
    assert first_request(q, policy, now=1.0).request_id == "no-slo"
    # Before any deadline passes, plain arrival order.
    assert plan_batch(q, SHAPES, budget(), policy, now=0.4).request_ids[:3] == ("old-a", "no-slo", "old-b")
    # At a measured pace of 1 ms per prompt token, new-c (200 tokens, due at 1.3) can no longer make it at t=1.15,
    # while new-d (40 tokens, due at 1.4) can: new-d goes first, new-c joins the late ones in arrival order.
    plan = plan_batch(q, SHAPES, budget(), policy, now=1.15, seconds_per_token=0.001)
    assert plan.request_ids == ("no-slo", "new-d", "old-a", "old-b", "new-c")
    # Across buckets too: split the queue by length, the bucket with the first on-time request goes first.
    q = make_queue(reqs, policy)
    while q.adjust(2):  # one split per call, until 200 and 40 tokens lie in buckets of their own
        pass
    assert q.bucket_index(200) != q.bucket_index(40), "the test needs two buckets"
    plan = plan_batch(q, SHAPES, budget(), policy, now=1.15, seconds_per_token=0.001)
    assert plan.request_ids == ("no-slo", "new-d", "old-b")
    # Off (late_last=False): the class's order alone.
    plain = PriorityPolicy(
        online_order="arrival", fill_with_other_class=False, short_batch_tokens=0, late_last=False
    )
    q = make_queue(reqs, plain)
    assert plan_batch(q, SHAPES, budget(), plain, now=1.0).request_ids[:2] == ("old-a", "no-slo")
    with pytest.raises(ValueError, match="late_last"):
        PriorityPolicy(late_last=1)


def test_offline_work_on_time_goes_before_online_work_that_is_late():
    policy = PriorityPolicy(online_order="arrival", offline_order="sjf", fill_with_other_class=False)
    reqs = [
        RequestSummary("on-late", 40, 8, ONLINE, arrival=0.0, ttft_slo_ms=500),
        RequestSummary("off-late", 30, 8, OFFLINE, arrival=0.1, ttft_slo_ms=500),
        RequestSummary("off-due-soon", 60, 8, OFFLINE, arrival=0.2, ttft_slo_ms=2000),
        RequestSummary("off-no-slo", 50, 8, OFFLINE, arrival=0.3),
    ]
    q = make_queue(reqs, policy)
    # At t=1.0 the online request is late: the offline ones that can still meet their TTFT go first, shortest
    # first (their class's order), and the late offline one after them.
    plan = plan_batch(q, SHAPES, budget(), policy, now=1.0)
    assert plan.priority_class is OFFLINE and plan.request_ids == ("off-no-slo", "off-due-soon", "off-late")
    # When everything queued is late, online work goes first as ever.
    q.remove_many(["off-no-slo", "off-due-soon"])
    plan = plan_batch(q, SHAPES, budget(), policy, now=3.0)
    assert plan.priority_class is ONLINE and plan.request_ids == ("on-late",)
    # An online request on time goes before all of them.
    q.add(RequestSummary("on-new", 40, 8, ONLINE, arrival=2.9, ttft_slo_ms=500))
    assert plan_batch(q, SHAPES, budget(), policy, now=3.0).request_ids == ("on-new", "on-late")


def test_a_late_request_still_runs_once_it_has_waited_max_online_wait_s():
    policy = PriorityPolicy(online_order="arrival", max_online_wait_s=10.0, fill_with_other_class=False)
    reqs = [RequestSummary("late", 900, 8, ONLINE, arrival=0.0, ttft_slo_ms=100)]
    reqs += [RequestSummary(f"s{i}", 20, 8, ONLINE, arrival=9.5, ttft_slo_ms=1000) for i in range(3)]
    q = make_queue(reqs, policy)
    plan = plan_batch(q, SHAPES, budget(), policy, now=9.9)
    assert plan is not None and not plan.by_guard and plan.request_ids[0] == "s0"
    plan = plan_batch(q, SHAPES, budget(), policy, now=10.0)
    assert plan is not None and plan.by_guard and plan.request_ids[0] == "late"


def test_offline_sjf_and_ljf():
    reqs = [RequestSummary(f"o{n}", n, 8, OFFLINE, arrival=0.0) for n in (300, 20, 700)]
    for order, first in (("sjf", "o20"), ("ljf", "o700")):
        policy = PriorityPolicy(offline_order=order)
        q = make_queue(reqs, policy)
        plan = plan_batch(q, SHAPES, budget(), policy, now=0.0)
        assert plan is not None and plan.request_ids[0] == first


def test_integer_priority_comes_before_arrival():
    policy = PriorityPolicy()
    reqs = [
        RequestSummary("a", 10, 8, ONLINE, priority=1, arrival=0.0),
        RequestSummary("b", 10, 8, ONLINE, priority=0, arrival=5.0),
    ]
    plan = plan_batch(make_queue(reqs, policy), SHAPES, budget(), policy, now=6.0)
    assert plan is not None and plan.request_ids == ("b", "a")


def test_aging_and_share_serve_offline_despite_online_load():
    reqs = [RequestSummary("old-offline", 500, 8, OFFLINE, arrival=0.0)] + [
        RequestSummary(f"on{i}", 20, 8, ONLINE, arrival=10.0 + i) for i in range(4)
    ]
    aging = PriorityPolicy(max_offline_wait_s=30.0, fill_with_other_class=False)
    q = make_queue(reqs, aging)
    assert plan_batch(q, SHAPES, budget(), aging, now=20.0).priority_class is ONLINE
    plan = plan_batch(q, SHAPES, budget(), aging, now=31.0)
    assert plan.request_ids == ("old-offline",) and plan.by_guard
    share = PriorityPolicy(
        starvation_guard="share", online_batches_per_offline=3, fill_with_other_class=False
    )
    q = make_queue(reqs, share)
    assert plan_batch(q, SHAPES, budget(), share, now=0.0, online_streak=2).priority_class is ONLINE
    assert plan_batch(q, SHAPES, budget(), share, now=0.0, online_streak=3).priority_class is OFFLINE
    never = PriorityPolicy(starvation_guard="none", fill_with_other_class=False)
    assert plan_batch(make_queue(reqs, never), SHAPES, budget(), never, now=1e9).priority_class is ONLINE


def test_a_batch_keeps_to_one_range_of_lengths_past_a_short_batch():
    policy = PriorityPolicy()
    assert policy.joins(100, 50, 50, 400), "within short_batch_tokens any length joins"
    assert not policy.joins(200, 50, 150, 900), "a long prompt does not join short ones"
    assert not policy.joins(900, 900, 900, 40), "nor a short one a long one's batch"
    assert policy.joins(900, 900, 900, 700) and not policy.joins(900, 900, 900, 1900)
    assert PriorityPolicy(short_batch_tokens=0).joins(200, 50, 150, 900), "0: lengths do not matter"
    with pytest.raises(ValueError, match="short_batch_tokens must be an int >= 0"):
        PriorityPolicy(short_batch_tokens=-1)
    # In arrival order: two short prompts, a longer one, then a short one again (a small short batch keeps the
    # test's padded shapes inside the token budget).
    policy = PriorityPolicy(online_order="arrival", short_batch_tokens=128)
    reqs = [RequestSummary(f"r{i}", n, 8, ONLINE, arrival=float(i)) for i, n in enumerate((60, 90, 300, 40))]
    q = make_queue(reqs, policy)
    plan = plan_batch(q, SHAPES, budget(), policy, now=5.0)
    assert plan is not None and plan.request_ids == ("r0", "r1"), (
        "the long prompt would hold their first tokens"
    )
    assert first_request(q, policy, now=5.0).request_id == "r0"
    for rid in plan.request_ids:
        q.remove(rid)
    plan = plan_batch(q, SHAPES, budget(), policy, now=5.0)
    assert plan is not None and plan.request_ids == ("r2",), (
        "the short one after it waits rather than ride along"
    )
    fcfs = PriorityPolicy(online_order="arrival", short_batch_tokens=0)
    plan = plan_batch(make_queue(reqs, fcfs), SHAPES, budget(), fcfs, now=5.0)
    assert plan is not None and plan.request_ids == ("r0", "r1", "r2", "r3")
    assert first_request(make_queue([], policy), policy, now=0.0) is None


def test_no_plan_when_the_first_request_does_not_fit_memory():
    policy = PriorityPolicy()
    q = make_queue([RequestSummary("big", 1000, 8, ONLINE)], policy)
    assert plan_batch(q, SHAPES, budget(prefill=10), policy, now=0.0) is None
    assert plan_batch(make_queue([], policy), SHAPES, budget(), policy, now=0.0) is None


def test_padding_is_reported():
    policy = PriorityPolicy(online_order="arrival")
    q = make_queue(
        [RequestSummary("a", 100, 8, ONLINE), RequestSummary("b", 30, 8, ONLINE, arrival=1.0)], policy
    )
    plan = plan_batch(q, SHAPES, budget(), policy, now=2.0)
    bs, length, ctx = plan.shape
    assert plan.request_ids == ("a", "b") and ctx == 0 and bs >= 2 and length >= 100
    assert plan.padded_tokens == bs * length - 130 and plan.real_tokens == 130
    assert plan.padding_ratio == pytest.approx(plan.padded_tokens / 130)


request_st = st.builds(
    lambda i, n, out, online, prio, arrival: RequestSummary(
        f"r{i}", n, out, ONLINE if online else OFFLINE, priority=prio, arrival=arrival
    ),
    st.integers(0, 10**9),
    st.integers(1, 1024),
    st.integers(1, 256),
    st.booleans(),
    st.integers(0, 2),
    st.floats(0, 100, allow_nan=False),
)
policy_st = st.builds(
    PriorityPolicy,
    online_order=st.sampled_from(["arrival", "deadline", "sjf"]),
    max_online_wait_s=st.floats(0, 50),
    offline_order=st.sampled_from(["sjf", "ljf"]),
    starvation_guard=st.sampled_from(["aging", "share"]),
    max_offline_wait_s=st.floats(0, 50),
    online_batches_per_offline=st.integers(1, 5),
    fill_with_other_class=st.booleans(),
)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(request_st, max_size=60, unique_by=lambda r: r.request_id),
    policy_st,
    st.integers(0, 3000),
    st.integers(0, 3000),
    st.booleans(),
    st.integers(1, 64),
)
def test_every_batch_fits_and_every_request_is_scheduled(
    requests, policy, prefill_free, decode_free, reserve, n_cap
):
    b = budget(prefill=prefill_free, decode=decode_free, reserve_output=reserve)
    # "While memory permits": queue the requests that fit the memory figures on their own. (One that never fits
    # holds the head of its order and there is no plan: covered by its own test.)
    servable = [
        r
        for r in requests
        if b.prefill_need(r.prompt_len) <= b.prefill_blocks
        and b.decode_need(r.prompt_len, r.max_tokens) <= b.decode_blocks
    ]
    q = make_queue(servable, policy)
    now, streak, scheduled = 100.0, 0, set()
    for _ in range(len(requests) + 1):
        q.adjust(n_cap)
        plan = plan_batch(q, SHAPES, b, policy, now=now, online_streak=streak)
        if plan is None:
            break
        batch = [q.get(rid) for rid in plan.request_ids]
        assert plan.shape is not None  # every request here fits one warmed shape alone
        bs, length, _ = plan.shape
        assert plan.shape in SHAPES.prompt
        assert len(batch) <= bs <= SHAPES.max_prompt_batch_size and max(r.prompt_len for r in batch) <= length
        assert sum(r.prompt_len for r in batch) <= b.max_num_batched_tokens == 2048
        assert sum(b.prefill_need(r.prompt_len) for r in batch) <= b.prefill_blocks
        assert sum(b.decode_need(r.prompt_len, r.max_tokens) for r in batch) <= b.decode_blocks
        assert plan.padded_tokens == bs * length - sum(r.prompt_len for r in batch) >= 0
        q.remove_many(plan.request_ids)
        scheduled.update(plan.request_ids)
        streak = 0 if plan.priority_class is OFFLINE else streak + 1
        now += 10.0  # time passes, so aging can act
    # No starvation: everything was scheduled, each request once.
    assert scheduled == {r.request_id for r in servable} and len(q) == 0
