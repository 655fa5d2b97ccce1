"""gRPC-only behaviour: token auth, parallel streams, automatic same-node fast path, registry."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.block_allocator import BlockAllocator
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import KVTransferError, TransferConfig, TransferStatus, create_transport, transport_names
from kv_transfer.endpoint import LocalEndpoint, gather_tokens

SPEC = KVCacheSpec(architecture="LlamaForCausalLM", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
BASE = {"chunk_bytes": 512, "shm_chunk_bytes": 512, "max_message_bytes": 1 << 20, "rpc_timeout_s": 10.0}


def _sender(**cfg) -> tuple:
    cache, alloc = KVCache(SPEC, 32), BlockAllocator(32)
    cache.data.normal_()
    backend = cfg.pop("backend", "grpc")
    return cache, alloc, create_transport(backend, cache, alloc, TransferConfig(**{**BASE, **cfg}))


def test_registry_lists_every_backend() -> None:
    assert {"grpc", "shm", "torch_dist", "local"} <= set(transport_names())
    with pytest.raises(ValueError, match="unknown backend"):
        create_transport("carrier-pigeon", KVCache(SPEC, 1), BlockAllocator(1))


def test_token_auth_refuses_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    rx = LocalEndpoint("grpc", SPEC, 32, TransferConfig(**BASE, auth_token="s3cret"))
    cache, alloc, bad = _sender(auth_token="wrong", same_node_fast_path=False)
    _, alloc2, good = _sender(auth_token="s3cret", same_node_fast_path=False)
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(KVTransferError) as e:
            bad.send(rx.address, "a", alloc.allocate(2), 8, first_token=1)
        assert e.value.status is TransferStatus.UNAUTHENTICATED
        assert "missing or bad token" in caplog.text
        assert alloc.num_used == 0
        good.send(rx.address, "b", alloc2.allocate(2), 8, first_token=1)
        assert rx.receive(5)["request_id"] == "b"
        assert rx.stats()["used_blocks"] == 0
    finally:
        bad.close()
        good.close()
        rx.close()


@pytest.mark.parametrize("streams", [1, 3])
def test_parallel_streams_deliver_everything(streams: int) -> None:
    rx = LocalEndpoint("grpc", SPEC, 64, TransferConfig(**BASE))
    cache, alloc, tx = _sender(num_streams=streams, same_node_fast_path=False)
    try:
        ids = alloc.allocate(SPEC.blocks_for_tokens(50))
        want = gather_tokens(cache, ids, 50).clone()
        m = tx.send(rx.address, "p", ids, 50, first_token=3)
        assert m.backend == "grpc" and m.chunks > streams
        assert torch.equal(rx.receive(5)["data"], want)
        assert alloc.num_used == 0 and rx.stats()["used_blocks"] == 0
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize(("fast_path", "expected"), [(True, "shm"), (False, "grpc")])
def test_same_node_peer_gets_the_fast_path_automatically(fast_path: bool, expected: str) -> None:
    rx = LocalEndpoint("grpc", SPEC, 64, TransferConfig(**BASE))
    cache, alloc, tx = _sender(same_node_fast_path=fast_path)
    try:
        assert tx.route(rx.address) == expected
        ids = alloc.allocate(3)
        want = gather_tokens(cache, ids, 12).clone()
        assert tx.send(rx.address, "auto", ids, 12, first_token=3).backend == expected
        assert torch.equal(rx.receive(5)["data"], want)
    finally:
        tx.close()
        rx.close()


def test_unreachable_peer_fails_within_the_deadline() -> None:
    cache, alloc, tx = _sender(same_node_fast_path=False, rpc_timeout_s=1.0)
    try:
        with pytest.raises(KVTransferError) as e:
            tx.send("127.0.0.1:1", "x", alloc.allocate(1), 4, first_token=1)
        assert e.value.status in (TransferStatus.UNAVAILABLE, TransferStatus.TIMEOUT)
        assert alloc.num_used == 0
    finally:
        tx.close()
