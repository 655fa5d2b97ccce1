"""The autoscaling policy (bucket_manager/autoscale.py) and the dispatcher's part in it, without a model or Ray:
when a role grows and shrinks, and how a worker joins, drains and leaves the ledger."""

from __future__ import annotations

import pytest

from bucket_manager.autoscale import RoleSignal, ScalingConfig, ScalingState, decide, idle, pressure

CFG = ScalingConfig(
    min_prefill_workers=1,
    max_prefill_workers=3,
    scale_ttft_budget_s=1.0,
    breach_s=2.0,
    scale_idle_s=30.0,
    cooldown_s=10.0,
)


def signal(**kw) -> RoleSignal:
    base = {
        "role": "prefill",
        "serving": 1,
        "starting": 0,
        "over_budget_for_s": None,
        "idle_for_s": None,
        "since_change_s": None,
    }
    return RoleSignal(**{**base, **kw})


def test_grows_after_a_breach_that_lasts_and_never_past_the_bound() -> None:
    assert decide(CFG, signal(over_budget_for_s=1.9)) == 0  # one slow batch is not a trend
    assert decide(CFG, signal(over_budget_for_s=2.0)) == 1
    assert decide(CFG, signal(over_budget_for_s=5.0, starting=1)) == 0  # one already on its way
    assert decide(CFG, signal(over_budget_for_s=5.0, serving=3)) == 0  # at max_prefill_workers
    assert decide(CFG, signal(over_budget_for_s=5.0, since_change_s=3.0)) == 0  # cooling down
    assert decide(CFG, signal(over_budget_for_s=5.0, since_change_s=10.0)) == 1


def test_shrinks_after_idling_and_never_below_the_bound() -> None:
    assert decide(CFG, signal(serving=2, idle_for_s=29.0)) == 0
    assert decide(CFG, signal(serving=2, idle_for_s=30.0)) == -1
    assert decide(CFG, signal(serving=1, idle_for_s=300.0)) == 0  # at min_prefill_workers
    assert decide(CFG, signal(role="decode", serving=1, idle_for_s=300.0)) == 0  # decode fixed at 1


def test_signals() -> None:
    assert pressure("prefill", CFG, 1.5, 0.0, 2, 2) and not pressure("prefill", CFG, 0.5, 1.0, 2, 2)
    assert not pressure("prefill", CFG, None, 0.0, 2, 2)  # nothing queued
    # Queued for long, but a prefill worker is free: the queue waits for decode memory, not for prefill.
    assert not pressure("prefill", CFG, 5.0, 0.95, 1, 2)
    assert pressure("decode", CFG, None, 0.95, 0, 1) and not pressure("decode", CFG, 9.0, 0.5, 1, 1)
    # A decode step over the TPOT budget (0.1 s) is pressure too, whatever the KV.
    assert pressure("decode", CFG, None, 0.2, 1, 1, step_s=0.15)
    assert not pressure("decode", CFG, None, 0.2, 1, 1, step_s=0.05)
    assert idle("prefill", CFG, 0, 0, 0.0) and not idle("prefill", CFG, 1, 0, 0.0)
    assert not idle("prefill", CFG, 0, 1, 0.0)  # a batch still on a worker
    assert idle("decode", CFG, 5, 1, 0.1) and not idle("decode", CFG, 0, 0, 0.5)


def test_state_times_the_decision_and_the_join() -> None:
    s = ScalingState(CFG)
    s.observe("prefill", 100.0, over_budget=True, is_idle=False)
    assert s.step("prefill", 101.0, serving=1) == 0
    s.observe("prefill", 102.0, over_budget=True, is_idle=False)  # still over: the clock keeps its start
    assert s.step("prefill", 102.0, serving=1) == 1
    event = s.started("prefill", "p:prefill-1", 102.0)
    assert s.step("prefill", 103.0, serving=1) == 0  # starting, and cooling down
    s.serving("p:prefill-1", 107.5)
    assert event.as_dict() == {
        "role": "prefill",
        "direction": "up",
        "worker_id": "p:prefill-1",
        "signal_to_decision_s": 2.0,
        "decision_to_done_s": 5.5,
    }
    # Idle from 110 on: drained at 140 (30 s idle; the cooldown from 107.5 is long over).
    s.observe("prefill", 110.0, over_budget=False, is_idle=True)
    assert s.step("prefill", 139.0, serving=2) == 0
    assert s.step("prefill", 140.0, serving=2) == -1
    s.drain("prefill", "p:prefill-1", 140.0)
    assert s.summary()["draining"] == ["p:prefill-1"]
    s.removed("p:prefill-1", 141.0)
    assert [e["direction"] for e in s.summary()["events"]] == ["up", "down"]
    assert s.summary()["events"][1]["signal_to_decision_s"] == 30.0


def test_a_start_that_never_joins_is_given_up() -> None:
    s = ScalingState(CFG)
    s.started("prefill", "p:prefill-1", 100.0)
    s.observe("prefill", 150.0, over_budget=True, is_idle=False)
    assert s.step("prefill", 200.0, serving=1) == 0  # over budget, but one is on its way
    assert s.overdue(200.0, 900.0) == [] and s.overdue(1001.0, 900.0) == ["p:prefill-1"]
    assert s.starting == {} and s.step("prefill", 1001.0, serving=1) == 1  # the role may try again


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_prefill_workers": 0}, "min_prefill_workers must be an int >= 1"),
        ({"max_decode_workers": 0}, "max_decode_workers must be an int >= ScalingConfig.min_decode_workers"),
        ({"scale_ttft_budget_s": 0}, "scale_ttft_budget_s must be > 0"),
        ({"kv_low": 0.95}, "kv_low and kv_high"),
    ],
)
def test_config_errors_name_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScalingConfig(**fields)


def test_dispatcher_joins_drains_and_removes_a_worker() -> None:
    from test_dispatcher import dispatcher, req

    d = dispatcher(prefill=1, decode=1, blocks=640)
    d.add_worker("prefill", "p1", 640)
    assert d.role_load("prefill")[0] == 1  # in the ledger, not yet planned for
    d.revive("p1", 640)
    assert d.role_load("prefill")[0] == 2
    d.drain("p1")
    assert d.role_load("prefill")[0] == 1 and d.drained("p1")
    d.submit(req(1, arrival=1.0), None)
    assert d.oldest_queued_arrival() == 1.0
    batches = d.plan(2.0)
    assert [b.prefill_id for b in batches] == ["p0"]  # never the draining worker
    assert d.oldest_queued_arrival() is None
    serving, busy, kv = d.role_load("decode")
    assert (serving, busy) == (1, 1) and 0 < kv < 1
    d.remove_worker("p1")
    assert "p1" not in d.prefill
    with pytest.raises(ValueError, match="already in the ledger"):
        d.add_worker("prefill", "p0", 640)
