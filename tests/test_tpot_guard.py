"""The TPOT guard (``engine/tpot_guard.py``): how long a step may take for the requests decoding in it, how many
prompt tokens fit in that time, the running estimates of what a step costs, and the flat step policy's prompt
cap; then through a real engine: the cap holds on a step's prompt tokens, and a guard that chunks every prompt
finely still gives Hugging Face's greedy tokens."""

from __future__ import annotations

import pytest
from engine_helpers import random_prompts, small_config
from hypothesis import given
from hypothesis import strategies as st

from engine.config import ConfigError, SchedulerConfig
from engine.scheduler import FlatLimits, SeqState, plan_flat_step
from engine.tpot_guard import FLOOR_TOKENS, DecodeClock, StepClock, prompt_token_cap, step_allowance_s


def test_allowance_is_the_tightest_requests_time_left_for_its_next_token() -> None:
    # 10 tokens out after the first in 0.3 s against 0.1 s each (x 0.9): 0.99 - 0.3 = 0.69 s for the 11th.
    ahead = DecodeClock(tpot_slo_s=0.1, tokens_after_first=10, since_first_s=0.3)
    # Just started: 0.09 s.
    fresh = DecodeClock(tpot_slo_s=0.1, tokens_after_first=0, since_first_s=0.0)
    # Late already: negative.
    late = DecodeClock(tpot_slo_s=0.05, tokens_after_first=4, since_first_s=0.5)
    assert step_allowance_s([ahead]) == pytest.approx(0.69)
    assert step_allowance_s([ahead, fresh]) == pytest.approx(0.09)
    assert step_allowance_s([ahead, late]) == pytest.approx(0.9 * 0.25 - 0.5)
    assert step_allowance_s([ahead], margin=1.0) == pytest.approx(0.8)
    assert step_allowance_s([]) is None


def test_cap_is_what_fits_beside_the_decodes_and_never_below_the_floor() -> None:
    assert prompt_token_cap(0.09, 0.01, 0.001) == 80
    assert prompt_token_cap(0.75, 0.25, 2**-10) == 512  # binary fractions: no rounding in the division
    assert prompt_token_cap(0.011, 0.01, 0.001) == FLOOR_TOKENS  # 1 token fits: the floor goes in anyway
    assert prompt_token_cap(-0.3, 0.01, 0.001) == FLOOR_TOKENS  # late: the floor, so prompts still progress
    assert prompt_token_cap(0.09, 0.01, 0.001, floor=100) == 100
    # Nothing to go by: no cap.
    assert prompt_token_cap(None, 0.01, 0.001) is None
    assert prompt_token_cap(0.09, 0.01, None) is None
    assert prompt_token_cap(0.09, None, 0.001) == 90  # no pure decode step timed yet: the prompt alone


def test_step_clock_learns_the_decode_step_and_the_prompt_token_cost() -> None:
    clock = StepClock()
    assert clock.decode_step_s is None and clock.prompt_s_per_token is None
    clock.observe(0.02, decodes=8, prompt_tokens=0)
    assert clock.decode_step_s == pytest.approx(0.02)
    clock.observe(0.05, decodes=0, prompt_tokens=0)  # an empty step teaches nothing
    assert clock.decode_step_s == pytest.approx(0.02)
    clock.observe(0.5, decodes=0, prompt_tokens=500)  # prompt alone: 1 ms a token
    assert clock.prompt_s_per_token == pytest.approx(0.001)
    for _ in range(60):  # mixed steps: the decodes' 20 ms come off before dividing
        clock.observe(0.02 + 0.002 * 200, decodes=8, prompt_tokens=200)
    assert clock.prompt_s_per_token == pytest.approx(0.002, rel=1e-3)
    before = clock.prompt_s_per_token
    clock.observe(1.0, decodes=8, prompt_tokens=4)  # too few prompt tokens to learn from
    assert clock.prompt_s_per_token == before


FL = FlatLimits(max_num_seqs=6, max_num_batched_tokens=64, block_size=16)


def decoding(rid: str, tokens: int) -> SeqState:
    return SeqState(rid, tokens - 1, tokens, -(-(tokens - 1) // 16))


def test_prompt_cap_bounds_the_prompt_tokens_not_the_decodes() -> None:
    mid = SeqState("mid", 20, 100, 2)  # part-way through its prompt
    running = [decoding("d0", 20), mid, decoding("d1", 33)]
    waiting = [SeqState("w0", 0, 50, 0)]
    # Decodes first, wherever they stand among the running requests: a chunk cannot take their budget.
    assert plan_flat_step(running, waiting, 100, FL).scheduled == (("d0", 1), ("d1", 1), ("mid", 62))
    capped = plan_flat_step(running, waiting, 100, FL, prompt_cap=10)
    assert capped.scheduled == (("d0", 1), ("d1", 1), ("mid", 10))
    # A cap spent by the running chunk leaves the waiting request for later.
    assert plan_flat_step(running, waiting, 100, FL, prompt_cap=0).scheduled == (("d0", 1), ("d1", 1))
    assert plan_flat_step([decoding("d0", 20)], waiting, 100, FL, prompt_cap=7).scheduled == (
        ("d0", 1),
        ("w0", 7),
    )


@st.composite
def _states(draw):
    running = []
    for i in range(draw(st.integers(0, FL.max_num_seqs))):
        total = draw(st.integers(2, 200))
        computed = draw(st.sampled_from([total - 1, draw(st.integers(1, total - 1))]))
        running.append(SeqState(f"r{i}", computed, total, -(-computed // 16)))
    waiting = [SeqState(f"w{i}", 0, draw(st.integers(1, 200)), 0) for i in range(draw(st.integers(0, 4)))]
    return running, waiting, draw(st.integers(0, 40)), draw(st.integers(0, 80))


@given(_states())
def test_a_capped_plan_keeps_its_cap_and_every_decode_an_uncapped_one_runs(states) -> None:
    running, waiting, free, cap = states
    plain = plan_flat_step(running, waiting, free, FL)
    capped = plan_flat_step(running, waiting, free, FL, prompt_cap=cap)
    by_id = {s.request_id: s for s in running + waiting}

    def is_decode(rid: str) -> bool:  # a running request with one token to compute; the rest are prompt work
        return rid.startswith("r") and by_id[rid].num_tokens - by_id[rid].num_computed == 1

    def prompt_tokens(plan) -> int:
        return sum(n for rid, n in plan.scheduled if not is_decode(rid))

    def decodes(plan) -> set[str]:
        return {rid for rid, _ in plan.scheduled if is_decode(rid)}

    assert prompt_tokens(capped) <= cap
    assert capped.num_tokens <= FL.max_num_batched_tokens
    assert decodes(plain) <= decodes(capped)  # less prompt work never costs a decode its token
    assert set(capped.preempt_ids) <= set(plain.preempt_ids)


def test_config_names_a_bad_tpot_guard_and_the_flag_reaches_it() -> None:
    import argparse

    from engine.args import add_engine_args
    from engine.config import config_from_args

    with pytest.raises(ConfigError, match="SchedulerConfig.tpot_guard"):
        SchedulerConfig(tpot_guard="on")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).scheduler.tpot_guard is False
    assert config_from_args(parser.parse_args(["--tpot-guard", "on"])).scheduler.tpot_guard is True


def _engine(guard: bool):
    """A flat-policy engine; with the guard, its step estimates as a slow host would have them: 10 ms decode
    steps, 1 ms a prompt token."""
    from dataclasses import replace

    from engine.llm_engine import LLMEngine

    base = small_config(shape_policy="flat", overlap_decode="off")
    engine = LLMEngine(replace(base, scheduler=replace(base.scheduler, tpot_guard=guard)))
    if guard:
        engine.step_clock.observe(0.010, decodes=1, prompt_tokens=0)
        engine.step_clock.observe(0.010 + 0.001 * 100, decodes=1, prompt_tokens=100)
    return engine


def _first_step_with_prompt(engine, slo_ms: float) -> int:
    """Start one request decoding (TPOT SLO ``slo_ms``), then queue a 200-token prompt: the prompt tokens of the
    first step that runs both."""
    from engine.request import Request, SamplingParams

    first, second = random_prompts([8, 200], seed=3)
    engine.add_request(
        Request("d", first, SamplingParams(max_tokens=30, ignore_eos=True), slo_tpot_ms=slo_ms)
    )
    # its 8-token prompt step is too small to teach the clock
    while not engine.requests["d"].output_token_ids:
        engine.step()
    engine.add_request(Request("p", second, SamplingParams(max_tokens=4), slo_tpot_ms=slo_ms))
    engine.step()
    done = engine.requests["p"].num_computed_tokens
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    return done


def test_engine_caps_a_steps_prompt_tokens_by_the_decodes_time_left() -> None:
    guarded = _engine(True)
    # 100 ms a token: 0.9 * 100 * (1 or 2 tokens) - elapsed, less 10 ms of decodes, at 1 ms a token.
    assert FLOOR_TOKENS <= _first_step_with_prompt(guarded, 100.0) <= 170
    # An SLO already spent: the floor.
    assert _first_step_with_prompt(_engine(True), 0.001) == FLOOR_TOKENS
    # Off: the token budget alone (256 here) takes the whole prompt.
    assert _first_step_with_prompt(_engine(False), 0.001) == 200


def test_a_guard_that_chunks_every_prompt_finely_keeps_greedy_exact(hf_reference) -> None:
    from engine.request import Request, SamplingParams

    engine = _engine(True)
    prompts = random_prompts([5, 90, 140, 33], seed=4)
    # A 1 us TPOT SLO: every step with a request decoding takes the floor of prompt tokens.
    reqs = [
        Request(f"g{i}", p, SamplingParams(max_tokens=12), slo_tpot_ms=0.001) for i, p in enumerate(prompts)
    ]
    engine.add_request(reqs[0])
    engine.step()
    for r in reqs[1:]:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats["prefill_steps"] >= (90 + 140 + 33) // FLOOR_TOKENS
    assert engine.stats["guarded_steps"] >= (90 + 140 + 33) // FLOOR_TOKENS - 1
    for r in reqs:
        assert r.output_token_ids == hf_reference(engine.loaded.path).greedy(r.prompt_token_ids, 12)
    engine.check_integrity()
