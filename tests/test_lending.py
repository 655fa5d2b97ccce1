"""Elastic prefill (``bucket_manager/lending.py``): when a decode worker with slack runs a prompt batch itself, how a
burst is spread over the idle executors, and how the dispatcher's ledger follows a lent batch. Pure Python."""

from __future__ import annotations

import pytest
from test_dispatcher import BS, dispatcher, req

from bucket_manager.lending import (
    LendingPolicy,
    Neighbour,
    batch_token_budget,
    colocated_borrow,
    lend_instead,
    pause_decode_for,
    pause_fits_tpot,
    widened_s,
    withdraw_to_lend,
)
from bucket_manager.memory_budget import blocks_for
from bucket_manager.priority import PriorityPolicy

ON = LendingPolicy(enabled=True)
STRICT = LendingPolicy(enabled=True, max_running=0)  # lends only while it decodes nothing
BY_ARRIVAL = PriorityPolicy(online_order="arrival")


def test_only_an_enabled_policy_lends_and_only_within_its_guard() -> None:
    assert not LendingPolicy().can_lend(0, 0), "off by default"
    assert ON.can_lend(0, 0) and ON.can_lend(ON.max_running, 0)
    assert not ON.can_lend(ON.max_running + 1, 0), (
        "a decode worker decoding more than max_running keeps its steps"
    )
    assert not ON.can_lend(0, 1), "one lent batch at a time"
    assert not STRICT.can_lend(1, 0)
    with pytest.raises(ValueError, match="max_running must be an int >= 0"):
        LendingPolicy(enabled=True, max_running=-1)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        LendingPolicy(enabled=True, max_tokens=0)


def test_a_decode_worker_lends_only_once_every_prefill_worker_holds_a_batch() -> None:
    assert not lend_instead([0, 1], 1, 128, 512), "a prefill worker with nothing queued takes it"
    assert lend_instead([1, 2], 1, 128, 512)
    assert lend_instead([], 1, 128, 512), "every prefill worker full"
    assert not lend_instead([1], 0, 128, 512)
    assert not lend_instead([1], 1, 600, 512), "a prompt longer than a lent batch waits for a prefill worker"


def test_a_burst_is_shared_evenly_over_the_workers_that_may_run_prompts() -> None:
    assert batch_token_budget(1024, 128, runners=2, cap=2048) == 512
    assert batch_token_budget(1024, 128, runners=1, cap=2048) == 2048, "one worker: the step budget"
    assert batch_token_budget(300, 200, runners=2, cap=2048) == 200, "never below the longest prompt"
    assert batch_token_budget(9000, 100, runners=2, cap=2048) == 2048, "never above the step budget"


def test_a_burst_runs_on_the_prefill_worker_and_on_the_idle_decode_worker() -> None:
    d = dispatcher(lending=STRICT, max_batches_per_prefill_worker=1)
    for i in range(12):
        d.submit(req(i, prompt=128, out=16), f"payload-{i}")
    first, second = d.plan(now=10.0)
    # The prefill worker's batch (4 prompts: its widest warmed batch), then the decode worker's own; the first
    # batch's requests are still in prefill, so the decode worker decodes nothing yet and may lend.
    assert (first.prefill_id, first.decode_id, first.lent) == ("p0", "d0", False)
    assert (second.prefill_id, second.decode_id, second.lent) == ("d0", "d0", True)
    assert len(first.request_ids) == len(second.request_ids) == 4 and len(d.queue) == 4
    lent = second.request_ids
    # One reservation per lent request, on the decode worker: prompt and output share its cache.
    assert all(d.decode["d0"].reserved[r] == blocks_for(128 + 16, BS) for r in lent)
    assert all(r not in d.prefill["p0"].reserved for r in lent)
    assert d.decode["d0"].outstanding == {second.batch_id: lent}
    assert all(d.placement[r] == ("d0", "d0") for r in lent)
    assert d.state()["lent_batches"] == 1
    assert d.plan(11.0) == [], "one lent batch at a time, and the prefill worker is full"
    # Its prompts are prefilled: it decodes them now, so it lends no more (max_running=0) ...
    d.batch_done("d0", second.batch_id)
    assert d.decode["d0"].outstanding == {} and all(r in d.decode["d0"].reserved for r in lent)
    d.batch_done("p0", first.batch_id)
    [third] = d.plan(12.0)
    assert not third.lent
    # ... until they end.
    for r in (*lent, *first.request_ids, *third.request_ids):
        d.forget(r)
    d.batch_done("p0", third.batch_id)
    assert d.decode["d0"].reserved == {} and d.prefill["p0"].reserved == {}


def test_a_burst_is_split_between_the_prefill_and_the_decode_worker() -> None:
    # Prompt batches as wide as the step budget allows: without the split the prefill worker would take all 8.
    d = dispatcher(lending=ON, max_batches_per_prefill_worker=1)
    for i in range(4):
        d.submit(req(i, prompt=256, out=16))
    first, second = d.plan(0.0)
    assert len(first.request_ids) == len(second.request_ids) == 2 and second.lent


def test_a_decode_worker_that_decodes_does_not_lend() -> None:
    d = dispatcher(lending=STRICT, max_batches_per_prefill_worker=1)
    d.submit(req(0, prompt=100, out=20))
    [only] = d.plan(0.0)
    d.batch_done("p0", only.batch_id)  # r0's KV reached d0: it decodes there now
    for i in range(1, 13):
        d.submit(req(i, prompt=128, out=16))
    # Past its guard (max_running=0): the burst queues for the prefill worker alone.
    batches = d.plan(1.0)
    assert len(batches) == 1 and not batches[0].lent


def test_without_lending_one_batch_takes_the_burst() -> None:
    d = dispatcher(max_batches_per_prefill_worker=1)
    for i in range(4):
        d.submit(req(i, prompt=256, out=16))
    [batch] = d.plan(0.0)
    assert len(batch.request_ids) == 4 and not batch.lent


def test_a_dead_decode_worker_strands_its_lent_requests() -> None:
    d = dispatcher(lending=ON, max_batches_per_prefill_worker=1)
    for i in range(8):
        d.submit(req(i, prompt=128, out=16))
    _, lent = d.plan(0.0)
    assert lent.lent
    on_decode, in_batches = d.stranded_by("d0")
    assert set(lent.request_ids) <= set(on_decode) and in_batches == []
    assert d.decode["d0"].outstanding == {}


def test_a_lent_batch_is_at_most_max_tokens_and_a_long_prompt_is_never_lent() -> None:
    d = dispatcher(lending=LendingPolicy(enabled=True, max_tokens=256), max_batches_per_prefill_worker=1)
    for i in range(12):
        d.submit(req(i, prompt=128, out=16))
    first, lent = d.plan(0.0)
    assert lent.lent and len(lent.request_ids) == 2, "256 tokens: two 128-token prompts"
    # A long prompt first in order is never lent, and the short ones behind it wait their turn.
    d2 = dispatcher(lending=ON, max_batches_per_prefill_worker=1, policy=BY_ARRIVAL)
    d2.submit(req(0, prompt=128, out=16))
    d2.submit(req(1, prompt=600, out=16))
    for i in range(2, 6):
        d2.submit(req(i, prompt=128, out=16))
    [first] = d2.plan(0.0)
    assert first.request_ids == ("r0",) and not first.lent, "a batch stays among its own lengths"
    assert d2.plan(0.0) == [], "r1 (600 tokens) heads the order: it waits for the prefill worker"
    # Short prompts ahead of a long one in the order go to the lender while the prefill worker is busy.
    d3 = dispatcher(lending=ON, max_batches_per_prefill_worker=1, policy=BY_ARRIVAL)
    d3.submit(req(0, prompt=600, out=16))
    for i in range(1, 5):
        d3.submit(req(i, prompt=128, out=16))
    d3.submit(req(5, prompt=900, out=16))
    on_prefill, lent = d3.plan(0.0)
    assert on_prefill.request_ids == ("r0",) and not on_prefill.lent
    assert lent.lent and lent.request_ids == ("r1", "r2", "r3", "r4"), "512 tokens of short prompts"
    assert "r5" in d3.queue, "the 900-token prompt waits for the prefill worker"


# ---------------------------------------------------------------- cores lent to a prefill batch
NEXT_DOOR = (("p0", ("d0",)),)  # d0 is pinned beside p0 on its node


def test_a_lone_prompt_borrows_the_idle_decode_workers_cores_until_its_batch_is_done() -> None:
    d = dispatcher(lending=ON, core_neighbours=NEXT_DOOR)
    d.submit(req(0, prompt=128, out=16))
    [first] = d.plan(0.0)
    assert (first.prefill_id, first.decode_id, first.borrowed) == ("p0", "d0", ("d0",))
    assert d.state()["core_shared_batches"] == 1 and d.state()["decode"]["d0"]["cores_lent"]
    # A prompt that comes while d0's cores run that batch is not lent to d0 (the two would share a core): it
    # queues behind the first on the prefill worker, which borrows nothing for it (it does not start at once).
    d.submit(req(1, prompt=128, out=16))
    [second] = d.plan(0.01)
    assert (second.prefill_id, second.lent, second.borrowed) == ("p0", False, ())
    d.batch_done("p0", first.batch_id)
    assert not d.state()["decode"]["d0"]["cores_lent"]
    # d0 now decodes r0 (and r1 is on its way): not idle, its cores stay its own.
    d.batch_done("p0", second.batch_id)
    d.submit(req(2, prompt=128, out=16))
    [third] = d.plan(1.0)
    assert third.borrowed == ()
    for r in ("r0", "r1", "r2"):
        d.forget(r)
    d.batch_done("p0", third.batch_id)
    d.submit(req(3, prompt=128, out=16))
    [fourth] = d.plan(2.0)
    assert fourth.borrowed == ("d0",), "idle again: lent again"
    assert d.state()["core_shared_batches"] == 2


def test_a_burst_runs_side_by_side_instead_of_borrowing() -> None:
    # Borrowing only for a batch that leaves nothing queued: a burst keeps both workers running batches.
    d = dispatcher(lending=ON, core_neighbours=NEXT_DOOR, max_batches_per_prefill_worker=1)
    for i in range(4):
        d.submit(req(i, prompt=256, out=16))
    first, second = d.plan(0.0)
    assert first.borrowed == () and second.lent


@pytest.mark.parametrize(
    ("policy", "neighbours"),
    [
        (LendingPolicy(enabled=True, share_cores=False), NEXT_DOOR),
        (LendingPolicy(enabled=False), NEXT_DOOR),
        (ON, ()),  # not on one node (or not pinned): nothing to share
        (ON, (("p0", ("d1",)),)),  # the neighbour is another decode worker
    ],
)
def test_cores_are_lent_only_when_enabled_and_next_door(policy, neighbours) -> None:
    d = dispatcher(decode=2, lending=policy, core_neighbours=neighbours)
    d.submit(req(0, prompt=128, out=16))
    [batch] = d.plan(0.0)
    assert batch.borrowed == () or batch.borrowed == ("d1",) and batch.decode_id != "d1"


def test_a_decode_worker_that_holds_a_request_keeps_its_cores() -> None:
    d = dispatcher(decode=2, lending=ON, core_neighbours=(("p0", ("d0", "d1")),))
    d.submit(req(0, prompt=128, out=16))
    [first] = d.plan(0.0)
    assert set(first.borrowed) == {"d0", "d1"}
    d.batch_done("p0", first.batch_id)
    d.submit(req(1, prompt=128, out=16))
    [second] = d.plan(1.0)
    # r0 decodes on one of them: only the other lends.
    assert second.borrowed == tuple(w for w in ("d0", "d1") if w != first.decode_id)


# ---------------------------------------------------------------- a busy decode worker paused for a long prompt
def test_a_batch_pauses_busy_decodes_only_when_that_turns_a_miss_into_a_hit() -> None:
    # 1.0 s alone, 0.56 s on two workers' cores (efficiency 0.9).
    assert widened_s(1.0, 1, 1) == pytest.approx(1.0 / 1.8)
    assert widened_s(1.0, 1, 0) == 1.0
    assert pause_decode_for(1.0, slack_s=0.66, own=1, borrowed=1, max_pause_s=0.8)
    assert not pause_decode_for(1.0, slack_s=1.2, own=1, borrowed=1, max_pause_s=0.8), "meets it alone"
    assert not pause_decode_for(1.0, slack_s=0.5, own=1, borrowed=1, max_pause_s=0.8), "misses it either way"
    assert not pause_decode_for(1.0, slack_s=0.66, own=1, borrowed=1, max_pause_s=0.5), "too long a pause"
    assert not pause_decode_for(1.0, slack_s=float("inf"), own=1, borrowed=1, max_pause_s=0.8), "no target"
    assert not pause_decode_for(0.0, slack_s=0.1, own=1, borrowed=1, max_pause_s=0.8), "pace unknown"
    assert not pause_decode_for(1.0, slack_s=0.66, own=1, borrowed=1, max_pause_s=0.0), "pausing off"
    assert not pause_decode_for(1.0, slack_s=0.66, own=1, borrowed=0, max_pause_s=0.8)
    with pytest.raises(ValueError, match="pause_decode_ms must be an int >= 0"):
        LendingPolicy(pause_decode_ms=-1)


def test_the_pauses_a_request_takes_stay_within_half_its_tpot_slack() -> None:
    # A 50 ms target, 20 ms steps, 65 tokens: (0.05 - 0.02) x 64 / 2 = 0.96 s of pauses over its life.
    assert pause_fits_tpot(0.5, [(0.0, 0.05, 65)], 0.02)
    assert pause_fits_tpot(0.46, [(0.5, 0.05, 65)], 0.02)
    assert not pause_fits_tpot(0.5, [(0.5, 0.05, 65)], 0.02), "its budget is spent"
    assert not pause_fits_tpot(0.2, [(0.0, 0.05, 5)], 0.02), "a short answer has little slack to give"
    assert not pause_fits_tpot(0.01, [(0.0, 0.05, 65)], 0.06), "its steps alone already miss the target"
    assert pause_fits_tpot(5.0, [(9.0, None, 65)], 0.02), "no TPOT target: no limit"
    assert not pause_fits_tpot(0.5, [(0.0, None, 65), (0.0, 0.05, 5)], 0.02), (
        "every request decoding there counts"
    )


def _busy_next_door(policy: LendingPolicy = ON, **decoding):
    """A dispatcher whose prefill worker runs 1 ms a token on its own core and whose neighbour d0 decodes r0."""
    d = dispatcher(lending=policy, core_neighbours=NEXT_DOOR)
    d.pace.observe(1000, 1.0)
    d.submit(req(0, prompt=64, **({"out": 64} | decoding)))
    [first] = d.plan(0.0)
    d.batch_done("p0", first.batch_id)  # r0 decodes on d0 now
    return d


@pytest.mark.parametrize(
    ("prompt", "slo_ms", "policy", "pauses"),
    [
        (800, 600.0, ON, True),  # 0.8 s alone, 0.44 s widened: the 600 ms target is met only widened
        (400, 600.0, ON, False),  # 0.4 s alone: meets it on its own core
        (1500, 600.0, ON, False),  # 0.83 s widened: misses it either way, the decodes keep their core
        (800, None, ON, False),  # no target: never pauses anyone
        (800, 600.0, LendingPolicy(enabled=True, pause_decode_ms=0), False),
        (800, 600.0, LendingPolicy(enabled=True, pause_decode_ms=300), False),  # the pause would be too long
    ],
)
def test_a_long_prompt_borrows_a_busy_decode_workers_cores_when_it_needs_them(
    prompt, slo_ms, policy, pauses
) -> None:
    d = _busy_next_door(policy)
    d.submit(req(1, prompt=prompt, out=16, arrival=1.0, ttft_slo_ms=slo_ms))
    [batch] = d.plan(1.0)
    assert batch.prefill_id == "p0" and not batch.lent
    assert batch.borrowed == (("d0",) if pauses else ())
    assert d.state()["decode_pausing_batches"] == int(pauses)


def test_the_decoding_requests_tpot_targets_bound_the_pauses() -> None:
    # r0: 50 ms TPOT target, 64 tokens, steps of 10 ms: (0.05 - 0.01) x 63 / 2 = 1.26 s of pauses; each 800-token
    # prompt pauses d0 for 0.44 s (0.8 s alone, widened), so two fit and the third keeps to the prefill core.
    d = _busy_next_door(tpot_slo_ms=50.0)
    d.update_stats({}, (), {"d0": 0.01})
    borrowed = []
    for i in range(1, 4):
        d.submit(req(i, prompt=800, out=16, arrival=float(i), ttft_slo_ms=600.0))
        [batch] = d.plan(float(i))
        borrowed.append(batch.borrowed)
        d.batch_done("p0", batch.batch_id)
        d.forget(f"r{i}")  # it ended: only r0 stays decoding on d0
    assert borrowed == [("d0",), ("d0",), ()]
    assert d.state()["decode_pausing_batches"] == 2
    # A request with a short answer has almost no slack to give: no pause at all.
    d = _busy_next_door(out=8, tpot_slo_ms=50.0)
    d.submit(req(1, prompt=800, out=16, arrival=1.0, ttft_slo_ms=600.0))
    [batch] = d.plan(1.0)
    assert batch.borrowed == ()


def test_a_long_prompt_that_waited_has_less_slack() -> None:
    # 0.5 s alone meets a 600 ms target on arrival; after 200 ms in the queue only the widened 0.28 s does.
    d = _busy_next_door()
    d.submit(req(1, prompt=500, out=16, arrival=1.0, ttft_slo_ms=600.0))
    [batch] = d.plan(1.2)
    assert batch.borrowed == ("d0",)


def test_a_busy_decode_worker_is_not_paused_for_a_batch_that_leaves_others_queued() -> None:
    # Each prompt alone would pause d0 (1.1 s alone, 0.61 s widened, an 800 ms target); two do not fit one batch,
    # so the first leaves one queued and the second queues behind it: both keep to the prefill worker's core.
    d = _busy_next_door(
        LendingPolicy(enabled=True, max_running=0)
    )  # d0 decodes r0: takes no lent batch either
    for i in (1, 2):
        d.submit(req(i, prompt=1100, out=16, arrival=1.0, ttft_slo_ms=800.0))
    batches = d.plan(1.0)
    assert len(batches) == 2 and all(b.borrowed == () for b in batches)
    assert d.state()["decode_pausing_batches"] == 0


def test_the_pace_counts_a_batch_on_borrowed_cores_as_its_time_alone() -> None:
    d = dispatcher(lending=ON, core_neighbours=NEXT_DOOR)
    d.submit(req(0, prompt=900, out=16))
    [batch] = d.plan(0.0)
    assert batch.borrowed == ("d0",)
    d.batch_done("p0", batch.batch_id, forward_s=0.5)
    # 0.5 s on two workers' cores is 0.9 s on its own: 1 ms a token.
    assert d.pace.seconds_per_token == pytest.approx(0.9 / 900)


def test_the_neighbours_are_validated() -> None:
    with pytest.raises(ValueError, match="DispatcherConfig.core_neighbours"):
        dispatcher(core_neighbours=(("p0", "d0"),))
    with pytest.raises(ValueError, match="LendingPolicy.share_cores must be a bool"):
        LendingPolicy(share_cores=1)


IDLE = Neighbour(prompt_tokens=0, decoding=0, pause_room_s=float("inf"))
PROMPTING = Neighbour(prompt_tokens=300, decoding=0, pause_room_s=float("inf"))


def _decoding(room_s: float = 10.0) -> Neighbour:
    return Neighbour(prompt_tokens=0, decoding=2, pause_room_s=room_s)


def _colocated(neighbours: list[Neighbour], **kw) -> list[int]:
    """A 512-token chunk of a 1,500-token prompt at 0.7 ms a token (0.36 s alone, 0.2 s on two cores; the rest
    1.05 s alone, 0.58 s on two), with an 800 ms TTFT target: late on one core, on time on two."""
    args = dict(
        prompt_tokens=512,
        step_alone_s=0.36,
        remaining_alone_s=1.05,
        slack_s=0.8,
        own=1,
        neighbours=neighbours,
        max_pause_s=0.8,
        min_tokens=128,
    )
    return colocated_borrow(**{**args, **kw})


def test_a_colocated_step_borrows_idle_neighbours_whenever_its_prompt_chunk_is_long() -> None:
    assert _colocated([IDLE, PROMPTING, IDLE]) == [0, 2]
    assert _colocated([IDLE], slack_s=float("inf"), remaining_alone_s=0.0, step_alone_s=0.0) == [0], (
        "an idle neighbour lends even without a target or a known pace"
    )
    assert _colocated([IDLE], prompt_tokens=100) == [], "a short chunk keeps to its own cores"
    assert _colocated([PROMPTING]) == [], "a neighbour with prompt work keeps its cores"


def test_a_colocated_step_pauses_a_decoding_neighbour_only_when_its_prompt_needs_it() -> None:
    assert _colocated([_decoding()]) == [0]
    assert _colocated([_decoding()], slack_s=2.0) == [], "on time alone: nobody paused"
    assert _colocated([_decoding()], slack_s=0.4) == [], "late even on two cores: not worth the decodes' time"
    assert _colocated([_decoding(room_s=0.1)]) == [], (
        "the neighbour's requests have no room for a 0.2 s pause"
    )
    assert _colocated([_decoding()], max_pause_s=0.1) == [], "the step would pause longer than allowed"
    assert _colocated([_decoding()], max_pause_s=0.0) == [], "pausing off"
    assert _colocated([_decoding()], step_alone_s=0.0, remaining_alone_s=0.0) == [], "pace unknown"
    # An idle neighbour's core is taken first; the decoding one is paused only if that is not enough.
    three = dict(remaining_alone_s=1.5, step_alone_s=0.36, slack_s=0.8)
    assert _colocated([IDLE, _decoding()], **three) == [0, 1]  # 0.83 s on two cores, 0.56 s on three
    assert _colocated([IDLE, _decoding()], remaining_alone_s=1.05) == [0]  # 0.58 s on two: on time


def test_a_queued_batch_is_withdrawn_only_to_turn_a_miss_into_a_hit() -> None:
    # 100 tokens (0.1 s), 1.4 s left of the batch ahead, 0.55 s to the deadline: late there, on time if lent now.
    assert withdraw_to_lend(100, 0.1, 1.4, 0.55, 512)
    assert not withdraw_to_lend(100, 0.1, 0.3, 0.55, 512), "on time behind the running batch anyway"
    assert not withdraw_to_lend(100, 0.1, 1.4, 0.05, 512), "late even if lent now"
    assert not withdraw_to_lend(600, 0.6, 1.4, 0.9, 512), "longer than a lent batch may be"
    assert not withdraw_to_lend(100, 0.1, 1.4, float("inf"), 512), "no TTFT target"
    assert not withdraw_to_lend(100, 0.0, 1.4, 0.55, 512), "pace unknown"
    assert not withdraw_to_lend(100, 0.1, 0.0, 0.55, 512), "the batch ahead should be done: it has started"


def _short_prompt_behind_a_long_one(ttft_slo_ms: float):
    """p0 runs a 1,500-token prompt (1.5 s at 1 ms a token) with a short online prompt queued behind it, queued
    there because d0 was running its one lent batch; that lent batch is done at t = 0.1."""
    d = dispatcher(lending=ON)
    d.pace.observe(1000, 1.0)
    d.submit(req(0, prompt=1500, out=16, arrival=0.0))
    [long_batch] = d.plan(0.0)
    d.submit(req(1, prompt=64, out=16, arrival=0.01))
    [lent] = d.plan(0.01)
    d.submit(req(2, prompt=100, out=16, arrival=0.05, ttft_slo_ms=ttft_slo_ms))
    [queued] = d.plan(0.05)
    assert not long_batch.lent and lent.lent and (queued.prefill_id, queued.lent) == ("p0", False)
    assert d.withdrawals(0.06) == [], "no decode worker is free to take it"
    d.batch_done("d0", lent.batch_id)
    return d, long_batch, queued


def test_a_short_prompt_queued_behind_a_long_one_is_taken_back_and_lent_when_a_decode_worker_frees_up() -> (
    None
):
    d, long_batch, queued = _short_prompt_behind_a_long_one(600.0)
    assert d.withdrawals(0.1) == [("p0", queued.batch_id)]
    assert d.take_back("p0", queued.batch_id) == ["r2"]
    # Its reservations are gone and it is queued again; the batch ahead is untouched.
    assert list(d.prefill["p0"].outstanding) == [long_batch.batch_id] and "r2" not in d.prefill["p0"].reserved
    assert "r2" not in d.decode["d0"].reserved and "r2" in d.queue and "r2" not in d.placement
    [again] = d.plan(0.1)
    assert again.lent and again.request_ids == ("r2",) and d.state()["withdrawn_batches"] == 1
    assert d.withdrawals(0.11) == [], "nothing is queued behind the long prompt now"


def test_a_queued_batch_that_makes_its_target_where_it_is_stays() -> None:
    d, _, _ = _short_prompt_behind_a_long_one(5000.0)
    assert d.withdrawals(0.1) == []


def test_a_request_aborted_while_its_batch_is_asked_back_is_not_queued_again() -> None:
    d, long_batch, queued = _short_prompt_behind_a_long_one(600.0)
    d.forget("r2")  # aborted while the prefill worker was being asked
    assert d.take_back("p0", queued.batch_id) == []
    assert list(d.prefill["p0"].outstanding) == [long_batch.batch_id] and "r2" not in d.queue


def test_a_batch_its_worker_kept_is_not_asked_back_again() -> None:
    d, _, queued = _short_prompt_behind_a_long_one(600.0)
    assert d.withdrawals(0.1) == [("p0", queued.batch_id)]
    d.keep("p0", queued.batch_id)  # the prefill worker had started it
    assert d.withdrawals(0.11) == []
