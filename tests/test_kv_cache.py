"""The paged KV cache's storage on the CPU: zeros that cost nothing until written."""

from __future__ import annotations

import gc
import os

import torch

from engine.kv_cache import KVCache, KVCacheSpec

SPEC = KVCacheSpec(architecture="LlamaForCausalLM", num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_cache_reads_as_zeros_and_takes_memory_only_where_written() -> None:
    blocks = 2048  # 4 layers x K/V x 2049 blocks x 16 KiB = 256 MiB
    before = _resident_bytes()
    cache = KVCache(SPEC, blocks)
    grown = _resident_bytes() - before
    assert cache.nbytes >= 256 << 20
    # Written up front (torch.zeros), the whole cache would be resident now: a worker's start paid for that.
    assert grown < cache.nbytes // 8, (
        f"{grown >> 20} MiB resident right after allocating {cache.nbytes >> 20} MiB"
    )
    assert cache.data.is_contiguous() and cache.data.dtype == torch.float32
    assert cache.data.shape == (4, 2, blocks + 1, 16, 4, 64)
    assert torch.count_nonzero(cache.data[:, :, ::97]) == 0  # reads as zeros (null block included)
    assert torch.count_nonzero(cache.data[:, :, blocks]) == 0
    cache.key_cache(2)[7, 3].fill_(1.5)
    cache.value_cache(1)[blocks].fill_(-2.0)
    assert float(cache.data[2, 0, 7, 3].sum()) == 1.5 * 4 * 64
    assert float(cache.data[1, 1, blocks].sum()) == -2.0 * 16 * 4 * 64
    assert torch.count_nonzero(cache.data) == 4 * 64 + 16 * 4 * 64


def test_views_outlive_the_cache_object() -> None:
    # A runner may hold a layer's view after the KVCache object is gone: the mapping must live with the tensor.
    cache = KVCache(SPEC, 8)
    view = cache.flat_slots(0, 1)
    view[5].fill_(3.0)
    del cache
    gc.collect()
    assert float(view[5].sum()) == 3.0 * 4 * 64
