"""Same-node zero-copy path: a KV cache allocated in shared memory is read in place by the
receiver (no staging copy), and the per-chunk checksum still catches a block changed mid-transfer."""

from __future__ import annotations

import gc
import os
import zlib
from pathlib import Path

import pytest
import torch

import kv_transfer.base as kv_base
from bench.kv_endpoint import EndpointProcess, gather_tokens
from engine.block_allocator import BlockAllocator
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import TransferConfig, create_transport
from kv_transfer.shm import ShmRing
from kv_transfer.wire import crc32

SPEC = KVCacheSpec(architecture="LlamaForCausalLM", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
CFG = TransferConfig(chunk_bytes=1024, shm_chunk_bytes=1024, max_message_bytes=1 << 20, rpc_timeout_s=20)
BLOCKS = 32


def test_shared_memory_cache_has_the_same_layout_and_is_unlinked() -> None:
    plain, shared = KVCache(SPEC, 5), KVCache(SPEC, 5, shared_memory=True)
    assert shared.data.shape == plain.data.shape and shared.data.dtype == plain.data.dtype
    assert shared.data.is_contiguous() and shared.nbytes == plain.nbytes
    assert torch.count_nonzero(shared.data) == 0
    assert plain.shm_name is None and shared.shm_name
    path = Path("/dev/shm") / shared.shm_name.lstrip("/")
    if path.parent.is_dir():
        assert path.exists()
        del shared
        gc.collect()
        assert not path.exists(), "the segment outlived its cache"


def test_crc32_is_zlibs_crc32() -> None:
    # Either side may compute it with either library: the values must be the same function.
    data = os.urandom(1 << 20) + b"tail"
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[7:], 12345) == zlib.crc32(data[7:], 12345)


@pytest.fixture(scope="module")
def endpoint():
    ep = EndpointProcess("grpc", SPEC, BLOCKS, CFG)
    ep.wait_ready()
    yield ep
    ep.close()


@pytest.fixture
def sender():
    cache = KVCache(SPEC, BLOCKS, shared_memory=True)
    cache.data.normal_()
    alloc = BlockAllocator(BLOCKS)
    tx = create_transport("shm", cache, alloc, CFG)
    yield tx
    tx.close()


@pytest.fixture
def ring_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    writes: list[int] = []
    real = ShmRing.write

    def counting(self: ShmRing, offset: int, views: list) -> int:
        writes.append(offset)
        return real(self, offset, views)

    monkeypatch.setattr(ShmRing, "write", counting)
    return writes


def test_consecutive_blocks_are_read_in_place(endpoint, sender, ring_writes: list[int]) -> None:
    ids = sender.allocator.allocate(6)
    assert ids == sorted(ids) and ids[-1] - ids[0] == 5  # one run of block ids
    want = gather_tokens(sender.cache, ids, 22).clone()  # [L, 2, 22, KVH, D]
    m = sender.send(endpoint.address, "inplace", ids, 22, first_token=1)
    assert m.backend == "shm" and m.chunks > 1
    assert ring_writes == [], "a chunk was staged through the ring"
    assert torch.equal(endpoint.receive(10)["data"], want)
    assert sender.allocator.num_used == 0


def test_scattered_blocks_fall_back_to_the_ring(endpoint, sender, ring_writes: list[int]) -> None:
    ids = sender.allocator.allocate(8)[::2]  # every other block: no chunk is one range
    want = gather_tokens(sender.cache, ids, 16).clone()
    assert sender.send(endpoint.address, "scattered", ids, 16, first_token=1).status == "ok"
    assert ring_writes
    assert torch.equal(endpoint.receive(10)["data"], want)
    sender.allocator.free([i + 1 for i in ids])


def test_block_changed_after_its_checksum_is_caught(
    endpoint, sender, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = kv_base.chunk_info
    hits: list[int] = []

    def then_overwrite(request_id, plan, views):
        info = real(request_id, plan, views)
        if plan.seq == 0 and not hits:
            # The receiver reads these very bytes later: a write into a leased block (a bug on
            # the sending side) must not reach the decoder.
            hits.append(1)
            views[0][0] = views[0][0] ^ 0xFF
        return info

    monkeypatch.setattr(kv_base, "chunk_info", then_overwrite)
    ids = sender.allocator.allocate(4)
    m = sender.send(endpoint.address, "changed", ids, 16, first_token=1)
    assert hits and m.attempts == 2, "the damaged first attempt was accepted"
    want = gather_tokens(sender.cache, ids, 16).clone()  # the second attempt sends the new bytes
    assert torch.equal(endpoint.receive(10)["data"], want)
    assert sender.allocator.num_used == 0
