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


# ---------------------------------------------------------------------------------------------- flat tokens
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine.scheduler import FlatLimits, SeqState, plan_flat_step  # noqa: E402

FL = FlatLimits(max_num_seqs=4, max_num_batched_tokens=64, block_size=16)


def decoding(rid: str, tokens: int) -> SeqState:
    """A running request about to compute its newest token, holding exactly the blocks of its cached tokens."""
    return SeqState(rid, tokens - 1, tokens, -(-(tokens - 1) // 16))


def test_flat_decodes_first_then_prefill_chunks_up_to_the_budget():
    running = [decoding("d0", 20), decoding("d1", 33)]
    waiting = [SeqState("w0", 0, 100, 0), SeqState("w1", 0, 10, 0)]
    plan = plan_flat_step(running, waiting, free_blocks=100, limits=FL)
    # Two decode tokens, then 62 of w0's 100 prompt tokens (a chunk); w1 waits for the next step.
    assert plan.scheduled == (("d0", 1), ("d1", 1), ("w0", 62))
    assert plan.num_tokens == 64 and plan.preempt_ids == ()


def test_flat_continues_a_chunked_prompt_before_admitting_new_work():
    mid = SeqState("w0", 62, 100, 4)  # 62 of 100 prompt tokens cached
    plan = plan_flat_step([mid], [SeqState("w1", 0, 10, 0)], free_blocks=100, limits=FL)
    assert plan.scheduled == (("w0", 38), ("w1", 10))


def test_flat_chunk_shrinks_to_the_free_blocks_and_keeps_a_reserve():
    running = [decoding("d0", 16)]  # its next token needs no new block (15 cached in 1 block, slot 16 free)
    plan = plan_flat_step(running, [SeqState("w0", 0, 100, 0)], free_blocks=3, limits=FL)
    # 3 free blocks, one kept for d0's next step: w0 gets 2 blocks' worth of tokens.
    assert plan.scheduled == (("d0", 1), ("w0", 32))


def test_flat_fcfs_stops_at_the_first_waiting_request_that_cannot_start():
    plan = plan_flat_step([], [SeqState("w0", 0, 40, 0), SeqState("w1", 0, 4, 0)], free_blocks=0, limits=FL)
    assert plan.scheduled == ()


def test_flat_preempts_the_newest_running_request_when_decodes_do_not_fit():
    running = [decoding("old", 17), decoding("new", 33)]  # each needs a new block for its next token
    plan = plan_flat_step(running, [], free_blocks=1, limits=FL)
    assert plan.preempt_ids == ("new",) and plan.scheduled == (("old", 1),)


def test_flat_respects_max_num_seqs():
    running = [decoding(f"d{i}", 5) for i in range(3)]
    waiting = [SeqState("w0", 0, 3, 0), SeqState("w1", 0, 3, 0)]
    plan = plan_flat_step(running, waiting, free_blocks=100, limits=FL)
    assert [rid for rid, _ in plan.scheduled] == ["d0", "d1", "d2", "w0"]


@st.composite
def _states(draw):
    running = []  # never more than max_num_seqs: the engine admits no more
    for i in range(draw(st.integers(0, FL.max_num_seqs))):
        total = draw(st.integers(2, 200))
        computed = draw(st.integers(1, total - 1))
        running.append(SeqState(f"r{i}", computed, total, -(-computed // 16)))
    waiting = [SeqState(f"w{i}", 0, draw(st.integers(1, 200)), 0) for i in range(draw(st.integers(0, 6)))]
    return running, waiting, draw(st.integers(0, 40))


@given(_states())
def test_flat_plan_never_exceeds_its_limits(states):
    running, waiting, free = states
    plan = plan_flat_step(running, waiting, free, FL)
    by_id = {s.request_id: s for s in running + waiting}
    assert plan.num_tokens <= FL.max_num_batched_tokens
    kept = [s for s in running if s.request_id not in plan.preempt_ids]
    assert len(kept) + sum(1 for rid, _ in plan.scheduled if rid.startswith("w")) <= FL.max_num_seqs
    # Preemption takes the newest first, and frees what it takes.
    assert (
        list(plan.preempt_ids)
        == [s.request_id for s in running[len(running) - len(plan.preempt_ids) :]][::-1]
    )
    freed = sum(by_id[r].blocks_held for r in plan.preempt_ids)
    need = 0
    for rid, n in plan.scheduled:
        s = by_id[rid]
        assert 1 <= n <= s.num_tokens - s.num_computed
        need += max(0, -(-(s.num_computed + n) // 16) - s.blocks_held)
    assert need <= free + freed
    # Nothing is scheduled twice, and no preempted request runs in the same step.
    ids = [rid for rid, _ in plan.scheduled]
    assert len(ids) == len(set(ids)) and not set(ids) & set(plan.preempt_ids)
