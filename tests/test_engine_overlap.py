"""Overlapped decode (``overlap_decode``): each decode step is launched before the previous step's tokens are read
back. What must hold besides greedy equality (``test_engine_greedy`` runs its tests on this mode too): a request
aborted while a step that computes it is in flight keeps its blocks until that step has run, and nothing that
needs the host between steps (sampling, logprobs) is overlapped."""

from __future__ import annotations

import pytest
from engine_helpers import random_prompts, small_config

from engine.config import ConfigError, EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, Request, SamplingParams


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(small_config(shape_policy="flat", overlap_decode="on"))


def test_abort_in_flight_keeps_blocks_until_the_step_ran(engine: LLMEngine, hf_reference) -> None:
    prompts = random_prompts([30, 50, 20], seed=11)
    reqs = [Request(f"a{i}", p, SamplingParams(max_tokens=24)) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    start = engine.stats["overlapped_steps"]
    while engine.stats["overlapped_steps"] < start + 3:
        engine.step()
    victim = reqs[1]
    assert engine._pending is not None and engine._pending.holds(victim)
    held, used = list(victim.block_ids), engine.allocator.num_used
    out = engine.abort(victim.request_id)
    assert out is not None and out.finished and out.finish_reason == FinishReason.ABORT
    # The step in flight writes one K/V slot in the victim's blocks: freeing them now could hand them to another
    # request under that write.
    assert victim.block_ids == held and engine.allocator.num_used == used
    engine.step()  # reads that step back (the victim's token is dropped), then frees the blocks
    assert victim.block_ids == [] and engine.allocator.num_used < used
    generated = len(victim.output_token_ids)
    while engine.has_unfinished():
        engine.step()
    assert len(victim.output_token_ids) == generated  # nothing appended after the abort
    for r in reqs:
        expected = hf_reference(engine.loaded.path).greedy(r.prompt_token_ids, 24)
        if r is victim:
            assert r.output_token_ids == expected[:generated]
        else:
            assert r.output_token_ids == expected, r.request_id
    engine.check_integrity()
    assert engine.allocator.num_used == 0


def test_sampling_and_logprobs_are_not_overlapped(engine: LLMEngine) -> None:
    prompt = random_prompts([16], seed=12)[0]
    for sp in (
        SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=8, logprobs=True, ignore_eos=True),
    ):
        before = engine.stats["overlapped_steps"]
        req = Request(f"s-{sp.temperature}-{sp.logprobs}", prompt, sp)
        engine.generate([req])
        assert len(req.output_token_ids) == 8
        assert engine.stats["overlapped_steps"] == before
    assert len(req.output_logprobs) == 8
    engine.check_integrity()


def test_overlap_is_checked_at_start_up() -> None:
    with pytest.raises(ConfigError, match="overlap_decode"):
        EngineConfig(overlap_decode="yes")
    with pytest.raises(ConfigError, match="overlap_decode 'on' needs shape_policy flat"):
        LLMEngine(small_config(shape_policy="buckets", overlap_decode="on"))
