"""Greedy output of the engine equals Hugging Face generate, token for token, under both shape policies: flat
tokens (decodes and prefill chunks mixed in one step) and padded shape buckets (bucketed prefill, a prompt above
every prompt bucket), through continuous batching with joins, leaves and preemption."""

from __future__ import annotations

import pytest
from engine_helpers import random_prompts, small_config

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams

POLICIES = ["flat", "buckets"]
# The flat policy with each decode step launched before the previous step's tokens are read back (CUDA's
# default; on by choice here, so the overlapped bookkeeping is checked on every machine).
ENGINES = {
    "flat": dict(shape_policy="flat", overlap_decode="off"),
    "buckets": dict(shape_policy="buckets"),
    "flat-overlap": dict(shape_policy="flat", overlap_decode="on"),
}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request):
    return LLMEngine(small_config(skip_warmup=False, **ENGINES[request.param]))


def test_greedy_matches_hf_with_continuous_batching(engine: LLMEngine, hf_reference) -> None:
    largest_query = max(q for _, q, _ in engine.buckets.prompt)
    lengths = [3, 17, 40, 1, largest_query + 44, 100, 64, 9, 250, 33]
    prompts = random_prompts(lengths, seed=1)
    max_tokens = [12, 30, 5, 20, 8, 25, 3, 40, 10, 16]
    reqs = [
        Request(f"r{i}", p, SamplingParams(max_tokens=m))
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    # Half join at once; the rest join one by one while the batch is decoding.
    for r in reqs[:5]:
        engine.add_request(r)
    late = list(reqs[5:])
    joined_mid_batch = left_mid_batch = 0
    while engine.has_unfinished() or late:
        outs = engine.step()
        if late and engine.running:
            engine.add_request(late.pop(0))
            joined_mid_batch += 1
        left_mid_batch += sum(1 for o in outs if o.finished and engine.running)
    assert joined_mid_batch == 5 and left_mid_batch >= 3
    assert engine.stats["decode_steps"] > 0
    assert (engine.stats["overlapped_steps"] > 0) == (engine.config.overlap_decode == "on")
    for r in reqs:
        expected = hf_reference(engine.loaded.path).greedy(r.prompt_token_ids, r.sampling.max_tokens)
        assert r.output_token_ids == expected, f"{r.request_id} (prompt {r.num_prompt_tokens} tokens) differs"
    if engine.config.shape_policy == "buckets":
        # The long prompt ran above every warmed prompt bucket: counted as a runtime compilation.
        assert engine.runner.runtime_compilations >= 1
    else:
        # Flat steps have no shape to miss; the long prompt went in chunks of the token budget.
        assert engine.runner.runtime_compilations == 0
        assert largest_query + 44 > engine.config.scheduler.max_num_batched_tokens
    engine.check_integrity()
    assert engine.allocator.num_used == 0


def test_long_contexts_decoded_in_parts_match_hf(hf_reference) -> None:
    """Decodes from 1,024 context slots on read their keys in parts (CPU kernel), merged afterwards; prompts just
    below, at and past that length decode across it, next to a short one, and stay token-exact."""
    engine = LLMEngine(
        small_config(
            cache=CacheConfig(block_size=64, num_blocks=96),
            scheduler=SchedulerConfig(
                max_model_len=2048, max_num_seqs=4, max_num_prefill_seqs=4, max_num_batched_tokens=2048
            ),
        )
    )
    prompts = random_prompts([1010, 1024, 1530, 40], seed=3)
    reqs = [
        Request(f"long{i}", p, SamplingParams(max_tokens=24, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    for r in reqs:
        expected = hf_reference(engine.loaded.path).greedy(r.prompt_token_ids, 24, ignore_eos=True)
        assert r.output_token_ids == expected, f"{r.request_id} (prompt {r.num_prompt_tokens} tokens) differs"
    engine.check_integrity()
    assert engine.allocator.num_used == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_recomputes_and_stays_exact(policy, hf_reference) -> None:
    # 16 blocks of 16 tokens cannot hold four ~41-token prompts growing by 60 tokens (28 blocks): requests are
    # preempted (blocks freed, recomputed later) and the output must still equal the reference.
    from engine.config import CacheConfig

    engine = LLMEngine(small_config(cache=CacheConfig(block_size=16, num_blocks=16), shape_policy=policy))
    prompts = random_prompts([40, 41, 42, 43], seed=2)
    reqs = [
        Request(f"p{i}", p, SamplingParams(max_tokens=60, ignore_eos=True)) for i, p in enumerate(prompts)
    ]
    engine.generate(reqs)
    assert engine.stats["preemptions"] > 0
    for r in reqs:
        assert len(r.output_token_ids) == 60
        expected = hf_reference(engine.loaded.path).greedy(r.prompt_token_ids, 60)
        if engine.loaded.eos_token_ids[0] not in expected:  # HF stops at EOS; ours ignores it here
            assert r.output_token_ids == expected
    engine.check_integrity()
    assert engine.allocator.num_used == 0


def test_stop_conditions(engine: LLMEngine, hf_reference) -> None:
    prompt = random_prompts([20], seed=3)[0]
    ref = hf_reference(engine.loaded.path).greedy(prompt, 20)
    # stop_token_ids: stop at the 5th reference token, which is included in the output.
    req = Request("stop-id", prompt, SamplingParams(max_tokens=20, stop_token_ids=(ref[4],)))
    engine.generate([req])
    assert req.output_token_ids == ref[: ref.index(ref[4]) + 1]
    assert req.finish_reason.value == "stop"
    # A stop string taken from the reference text cuts the text before it.
    text = engine.tokenizer.decode(ref, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        req = Request("stop-str", prompt, SamplingParams(max_tokens=20, stop=(stop,)))
        engine.generate([req])
        assert req.finish_reason.value == "stop"
        assert stop not in req.output_text and text.startswith(req.output_text)
    req = Request("len", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.generate([req])
    assert len(req.output_token_ids) == 3 and req.finish_reason.value == "length"


def test_too_long_prompt_is_rejected_with_the_limit(engine: LLMEngine) -> None:
    from engine.llm_engine import RequestRejected

    with pytest.raises(RequestRejected, match="max_model_len is 512"):
        engine.add_request(Request("long", [5] * 600))


def test_stop_string_check_decodes_a_bounded_tail(engine: LLMEngine, monkeypatch) -> None:
    # 200 tokens with a stop string that never matches: each token's check decodes a bounded tail, not the whole
    # output (which made long generations quadratic); the result equals the run without stop strings.
    prompt = random_prompts([12], seed=5)[0]
    plain = Request("no-stop", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    engine.generate([plain])
    decoded: list[int] = []
    real = engine.tokenizer.decode

    def counting(ids, *a, **kw):
        decoded.append(len(ids))
        return real(ids, *a, **kw)

    monkeypatch.setattr(engine.tokenizer, "decode", counting)
    stop = "\x00never\x00"
    req = Request("tail", prompt, SamplingParams(max_tokens=200, ignore_eos=True, stop=(stop,)))
    engine.generate([req])
    assert req.output_token_ids == plain.output_token_ids and req.finish_reason.value == "length"
    assert len(decoded) == 200 and max(decoded) <= 4 * len(stop) + 8
