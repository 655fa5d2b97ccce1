"""Padding to a shape bucket never changes the logits of the real rows."""

from __future__ import annotations

import torch
from engine_helpers import TEST_DEVICE, random_prompts, small_config

from engine.block_allocator import BlockAllocator
from engine.device import get_device
from engine.kv_cache import KVCache
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.request import Request


def _runner(engine: LLMEngine, buckets) -> tuple[ModelRunner, BlockAllocator]:
    kv = KVCache(engine.kv_spec, 128, device=TEST_DEVICE)
    return ModelRunner(engine.loaded.model, kv, get_device(TEST_DEVICE), buckets, 512), BlockAllocator(128)


def _reqs(alloc: BlockAllocator, lengths: list[int]) -> list[Request]:
    reqs = []
    for i, p in enumerate(random_prompts(lengths, seed=7)):
        r = Request(f"x{i}", p)
        r.block_ids = alloc.allocate(-(-(len(p) + 1) // 16))
        reqs.append(r)
    return reqs


def test_prompt_and_decode_padding_keep_real_rows_exact() -> None:
    engine = LLMEngine(small_config(shape_policy="buckets"))
    padded, alloc_a = _runner(engine, engine.buckets)
    plain, alloc_b = _runner(engine, None)
    lengths = [5, 19, 37]  # 3 rows, query 37: pads to a (4, 48)-like bucket
    ra, rb = _reqs(alloc_a, lengths), _reqs(alloc_b, lengths)
    batch = padded.prepare_prompt(ra)
    assert batch.shape != (3, 37, 0), "the test needs a batch that is actually padded"
    assert batch.shape[0] >= 3 and batch.shape[1] >= 37
    la, lb = padded.execute(batch), plain.prefill(rb)
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    for reqs, logits in ((ra, la), (rb, lb)):
        for r, row in zip(reqs, logits, strict=True):
            r.num_computed_tokens = r.num_tokens
            r.output_token_ids.append(int(row.argmax()))
    da = padded.prepare_decode(ra)
    assert da.shape[0] >= 3 and da.shape[2] > sum(
        len(r.block_ids[: (r.num_tokens - 1) // 16 + 1]) for r in ra
    )
    torch.testing.assert_close(padded.execute(da), plain.decode(rb), rtol=1e-5, atol=1e-5)
    # Padding wrote only into the null block: the real blocks of both caches hold the same K/V.
    used = [b for r in ra for b in r.block_ids]
    used_b = [b for r in rb for b in r.block_ids]
    torch.testing.assert_close(padded.kv.read_blocks(used), plain.kv.read_blocks(used_b))
