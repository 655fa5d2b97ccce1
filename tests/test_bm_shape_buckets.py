"""Shape-bucket generation and lookup: DESIGN.md's worked examples, validation, overrides, and lookup properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bucket_manager.bucket_range import BucketRange, exponential_values, linear_values
from bucket_manager.shape_buckets import ShapeBucketConfig, ShapeBuckets, env_name

DESIGN_DECODE_BLOCKS = [128, 256, 384, 512, 640, 768, 896, 1024, 1408, 1792, 2432, 3328, 4352, 5888]


def design_example(env: dict[str, str] | None = None) -> ShapeBuckets:
    cfg = ShapeBucketConfig.from_serving(
        strategy="exponential",
        block_size=128,
        max_model_len=1024,
        max_num_seqs=4,
        max_num_prefill_seqs=1,
        num_blocks=5775,
        prefix_caching=True,
        env=env or {},
    )
    return ShapeBuckets(cfg)


def test_exponential_query_range_is_every_multiple_of_128():
    assert exponential_values(128, 128, 1024, 11) == list(range(128, 1025, 128))


def test_exponential_decode_blocks_match_design():
    limit = math.ceil(math.log2(5775)) + 1
    assert exponential_values(128, 128, 5775, limit) == DESIGN_DECODE_BLOCKS


def test_linear_examples_match_design():
    assert linear_values(2, 32, 64) == [2, 4, 8, 16, 32, 64]
    assert linear_values(128, 128, 512) == [128, 256, 384, 512]


def test_design_prompt_buckets_with_prefix_context():
    sb = design_example()
    expected = sorted((1, q, i) for q in range(128, 1025, 128) for i in range(8) if q + i * 128 <= 1024)
    assert len(expected) == 36
    assert sb.prompt == expected
    assert sb.prompt[0] == (1, 128, 0) and sb.prompt[7] == (1, 128, 7) and sb.prompt[-1] == (1, 1024, 0)


def test_design_decode_buckets():
    sb = design_example()
    expected = [(bs, 1, n) for bs in (1, 2, 4) for n in DESIGN_DECODE_BLOCKS]
    assert sb.decode == expected
    assert len(sb.decode) == 42


def test_without_prefix_caching_context_is_zero():
    cfg = ShapeBucketConfig.from_serving(block_size=128, max_model_len=1024, max_num_prefill_seqs=1, env={})
    sb = ShapeBuckets(cfg)
    assert [b for b in sb.prompt] == [(1, q, 0) for q in range(128, 1025, 128)]


def test_decode_drops_fewer_blocks_than_sequences():
    cfg = ShapeBucketConfig.from_serving(
        block_size=16, max_model_len=256, max_num_seqs=64, num_blocks=300, env={}
    )
    sb = ShapeBuckets(cfg)
    assert all(n >= bs for bs, _, n in sb.decode)
    assert (64, 1, 16) not in sb.decode
    assert any(bs == 64 for bs, _, _ in sb.decode)


def test_prompt_respects_batched_tokens():
    cfg = ShapeBucketConfig.from_serving(
        block_size=16, max_model_len=2048, max_num_prefill_seqs=16, max_num_batched_tokens=4096, env={}
    )
    sb = ShapeBuckets(cfg)
    assert all(bs * q <= 4096 for bs, q, _ in sb.prompt)
    assert (1, 2048, 0) in sb.prompt and (16, 240, 0) in sb.prompt and (16, 352, 0) not in sb.prompt


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min": 5, "step": 1, "max": 4, "limit": 2}, "min"),
        ({"min": 1, "step": 0, "max": 4, "limit": 2}, "step"),
        ({"min": 1, "step": 1, "max": 4, "limit": 0}, "limit"),
        ({"min": -1, "step": 1, "max": 4, "limit": 2}, "min"),
    ],
)
def test_impossible_range_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=rf"decode_bs\.{message}"):
        BucketRange(name="decode_bs", **fields)


def test_env_overrides_each_dimension():
    env = {
        env_name("prompt_seq", "max"): "512",
        env_name("decode_block", "step"): "256",
        env_name("decode_block", "min"): "256",
    }
    sb = design_example(env)
    assert max(q for _, q, _ in sb.prompt) == 512
    assert sb.config.decode_block.step == 256
    assert all(n % 256 == 0 for _, _, n in sb.decode)


def test_env_override_errors_name_the_variable():
    with pytest.raises(ValueError, match="BUCKETSERVE_PROMPT_SEQ_BUCKET_MIN"):
        design_example({"BUCKETSERVE_PROMPT_SEQ_BUCKET_MIN": "lots"})
    with pytest.raises(ValueError, match="prompt_seq.min"):
        design_example({"BUCKETSERVE_PROMPT_SEQ_BUCKET_MIN": "4096"})


def test_config_overrides_lose_to_env():
    cfg = ShapeBucketConfig.from_serving(
        block_size=128,
        max_model_len=1024,
        overrides={"prompt_seq": {"max": 768}},
        env={env_name("prompt_seq", "max"): "512"},
    )
    assert cfg.prompt_seq.max == 512
    with pytest.raises(ValueError, match="prompt_seq.width"):
        ShapeBucketConfig.from_serving(overrides={"prompt_seq": {"width": 3}}, env={})


def test_serving_flags_are_validated():
    with pytest.raises(ValueError, match="max_num_seqs"):
        ShapeBucketConfig.from_serving(max_num_seqs=0, env={})
    with pytest.raises(ValueError, match="strategy"):
        ShapeBucketConfig.from_serving(strategy="cubic", env={})


def test_lookup_examples():
    sb = design_example()
    assert sb.find_prompt(1, 412, 0) == (1, 512, 0)
    assert sb.find_prompt(1, 300, 3) == (1, 384, 3)
    assert sb.find_prompt(1, 1000, 1) is None  # 1024 + 128 > max_model_len: no such shape
    assert sb.find_prompt(2, 100, 0) is None  # above the largest warmed prefill batch
    assert sb.find_decode(3, 412) == (4, 1, 512)
    assert sb.find_decode(4, 2) == (4, 1, 128)
    assert sb.find_decode(1, 6000) is None


def _brute(buckets, target):
    return next((b for b in buckets if all(x >= t for x, t in zip(b, target, strict=True))), None)


serving = st.fixed_dictionaries(
    {
        "strategy": st.sampled_from(["exponential", "linear"]),
        "block_size": st.sampled_from([8, 16, 64, 128]),
        "max_model_len": st.integers(64, 4096),
        "max_num_seqs": st.integers(1, 256),
        "max_num_prefill_seqs": st.integers(1, 32),
        "max_num_batched_tokens": st.integers(256, 8192),
        "num_blocks": st.integers(1, 20000),
        "prefix_caching": st.booleans(),
    }
)


@settings(max_examples=60, deadline=None)
@given(serving, st.data())
def test_lookup_is_first_dominating_bucket(flags, data):
    sb = ShapeBuckets(ShapeBucketConfig.from_serving(env={}, **flags))
    assert sb.prompt == sorted(set(sb.prompt)) and sb.decode == sorted(set(sb.decode))
    for _ in range(20):
        bs = data.draw(st.integers(1, flags["max_num_prefill_seqs"] + 2))
        q = data.draw(st.integers(1, flags["max_model_len"] + 64))
        ctx = data.draw(st.integers(0, flags["max_model_len"] // flags["block_size"] + 2))
        assert sb.find_prompt(bs, q, ctx) == _brute(sb.prompt, (bs, q, ctx))
        dbs = data.draw(st.integers(1, flags["max_num_seqs"] + 2))
        blocks = data.draw(st.integers(dbs, max(dbs, flags["num_blocks"]) + 200))
        assert sb.find_decode(dbs, blocks) == _brute(sb.decode, (dbs, 1, blocks))


@settings(max_examples=60, deadline=None)
@given(serving, st.data())
def test_every_servable_batch_has_a_bucket(flags, data):
    """Any decode batch the cache can hold and any single prompt the model accepts pads onto a warmed shape."""
    sb = ShapeBuckets(ShapeBucketConfig.from_serving(env={}, **flags))
    dbs = data.draw(st.integers(1, min(flags["max_num_seqs"], flags["num_blocks"])))
    blocks = data.draw(st.integers(dbs, flags["num_blocks"]))
    assert sb.find_decode(dbs, blocks) is not None
    q = data.draw(st.integers(1, min(flags["max_model_len"], flags["max_num_batched_tokens"])))
    assert sb.find_prompt(1, q, 0) is not None
