"""Shared helpers for engine tests: the test device, a small engine config, random prompts, greedy outputs and
the skip marker of the bf16 fusion tests (the Hugging Face reference is the ``hf_reference`` fixture in
conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import BucketingConfig, CacheConfig, EngineConfig, SchedulerConfig
from engine.linear_prepack import can_prepack

# The engine tests run on the CPU; BUCKETSERVE_TEST_DEVICE=cuda runs the same tests on a GPU, with the
# Hugging Face reference on that GPU too (fp32 on both sides, so greedy outputs stay comparable).
TEST_DEVICE = os.environ.get("BUCKETSERVE_TEST_DEVICE", "cpu")

# The engine's own choice (can_prepack): bf16 linears are prepacked (and so bf16 MLPs and attention layers fused,
# and the decoder stack walked) only where oneDNN has a bf16 path; on an AVX2-only CPU the reorder raises and bf16
# models keep their own forwards (test_bf16_linears_are_prepacked_only_where_onednn_has_a_bf16_path covers it).
needs_onednn_bf16 = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.bfloat16),
    reason="oneDNN has no bf16 path on this CPU (no AVX-512 BW/VL/DQ or AVX-NE-CONVERT): bf16 linears are not "
    "prepacked here (they stay F.linear), so nothing is fused in bf16",
)


def small_config(**kw) -> EngineConfig:
    """The tiny model with a small bucket grid: fast warm-up, prompts above 256 tokens exceed it."""
    defaults = dict(
        model="tiny",
        device=TEST_DEVICE,
        skip_warmup=True,
        cache=CacheConfig(block_size=16, num_blocks=256),
        scheduler=SchedulerConfig(
            max_model_len=512, max_num_seqs=8, max_num_prefill_seqs=4, max_num_batched_tokens=256
        ),
        bucketing=BucketingConfig(strategy="exponential"),
    )
    defaults.update(kw)
    return EngineConfig(**defaults)


def random_prompts(lengths: list[int], seed: int = 0, vocab: tuple[int, int] = (10, 4000)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab[0], vocab[1], (n,), generator=g).tolist() for n in lengths]


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy output tokens, all run together on ``engine``."""
    from engine.request import Request, SamplingParams

    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]
