"""Prefill reports each layer as its K/V land in the cache, in order, before the logits exist."""

from __future__ import annotations

import pytest
from engine_helpers import random_prompts, small_config

from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams


@pytest.mark.parametrize("policy", ["flat", "buckets"])
def test_layer_hook_sees_every_layer_in_order_with_kv_written(policy) -> None:
    engine = LLMEngine(small_config(shape_policy=policy))
    req = Request("h", random_prompts([30], seed=9)[0], SamplingParams(max_tokens=2))
    seen: list[int] = []
    snapshots: list[float] = []

    def hook(layer: int) -> None:
        seen.append(layer)
        # The request's blocks hold this layer's keys already when the hook runs.
        snapshots.append(float(engine.kv_cache.read_blocks(req.block_ids, layer=layer).abs().sum()))

    engine.prefill_only([req], on_layer_written=hook)
    assert seen == list(range(engine.kv_spec.num_layers))
    assert all(s > 0 for s in snapshots)
    out = engine.detach("h")
    engine.allocator.free(out.block_ids)
    engine.check_integrity()
    assert engine.allocator.num_used == 0
