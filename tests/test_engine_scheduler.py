"""The continuous-batching step policy, without a model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.scheduler import RunningSeq, StepLimits, WaitingSeq, plan_step

LIMITS = StepLimits(max_num_seqs=4, max_num_prefill_seqs=2, max_num_batched_tokens=100)


def test_prefill_first_within_limits() -> None:
    waiting = [WaitingSeq("a", 60, 4), WaitingSeq("b", 30, 2), WaitingSeq("c", 5, 1)]
    plan = plan_step(waiting, [], free_blocks=100, limits=LIMITS)
    assert plan.kind == "prefill" and plan.request_ids == ("a", "b")  # max_num_prefill_seqs
    plan = plan_step([WaitingSeq("a", 80, 5), WaitingSeq("b", 30, 2)], [], 100, LIMITS)
    assert plan.request_ids == ("a",)  # batched-token limit
    plan = plan_step([WaitingSeq("a", 500, 40)], [], 100, LIMITS)
    assert plan.request_ids == ("a",)  # a single long prompt still runs alone


def test_decode_when_nothing_fits_or_batch_full() -> None:
    running = [RunningSeq(str(i), 0, 2) for i in range(4)]
    plan = plan_step([WaitingSeq("w", 10, 1)], running, 50, LIMITS)
    assert plan.kind == "decode" and len(plan.request_ids) == 4  # max_num_seqs reached
    plan = plan_step([WaitingSeq("w", 10, 9)], running[:1], 9, LIMITS)
    assert plan.kind == "decode"  # admitting would eat the running request's reserve block


def test_preemption_newest_first_until_fit() -> None:
    running = [RunningSeq("old", 1, 3), RunningSeq("mid", 1, 3), RunningSeq("new", 1, 3)]
    plan = plan_step([], running, free_blocks=1, limits=LIMITS)
    assert plan.kind == "decode" and plan.preempt_ids == ("new",) and plan.request_ids == ("old", "mid")


@settings(max_examples=300, deadline=None)
@given(
    waiting=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 20)), max_size=8),
    running=st.lists(st.tuples(st.integers(0, 1), st.integers(1, 20)), max_size=6),
    free=st.integers(0, 40),
)
def test_plans_always_fit(waiting, running, free) -> None:
    w = [WaitingSeq(f"w{i}", t, b) for i, (t, b) in enumerate(waiting)]
    r = [RunningSeq(f"r{i}", n, h) for i, (n, h) in enumerate(running)]
    plan = plan_step(w, r, free, LIMITS)
    if plan.kind == "prefill":
        chosen = [x for x in w if x.request_id in plan.request_ids]
        assert [x.request_id for x in chosen] == [x.request_id for x in w[: len(chosen)]]  # FCFS prefix
        assert sum(x.blocks_needed for x in chosen) <= free
        assert len(chosen) <= LIMITS.max_num_prefill_seqs and len(r) + len(chosen) <= LIMITS.max_num_seqs
    elif plan.kind == "decode":
        kept = [x for x in r if x.request_id in plan.request_ids]
        freed = sum(x.blocks_held for x in r if x.request_id in plan.preempt_ids)
        assert sum(x.blocks_needed for x in kept) <= free + freed
        assert set(plan.request_ids) | set(plan.preempt_ids) == {x.request_id for x in r}
    else:
        assert not r
