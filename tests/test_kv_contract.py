"""One contract for every KV transport backend: the receiver runs in its own process (in-process for
``local``), the sender here; real caches, allocators, gRPC servers, shared memory and gloo."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from bench.kv_endpoint import EndpointProcess, LocalEndpoint, gather_tokens
from bench.server_process import free_port
from engine.block_allocator import BlockAllocator
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import FaultInjector, KVTransferError, TransferConfig, TransferStatus, create_transport

SPEC = KVCacheSpec(architecture="LlamaForCausalLM", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
SENDER_BLOCKS = 64
RECEIVER_BLOCKS = 48
# 256-byte block layers and 1 KiB chunks: several chunks per layer, so mid-transfer paths exist.
CFG = TransferConfig(
    chunk_bytes=1024, shm_chunk_bytes=1024, max_message_bytes=1 << 20, reap_interval_s=0.05, rpc_timeout_s=20
)
# "shm-zero-copy": the shm backend from a KV cache allocated in shared memory (read in place).
BACKENDS = ["local", "grpc", "shm", "shm-zero-copy", "torch_dist"]
# Both caches live on the host here; BUCKETSERVE_TEST_DEVICE=cuda puts them on a GPU (as on GPU prefill and
# decode workers), except the zero-copy one, which is host shared memory by definition.
DEVICE = os.environ.get("BUCKETSERVE_TEST_DEVICE", "cpu")
# torch_dist takes its backend from the cache's device (nccl on CUDA), but NCCL refuses two ranks on one GPU:
# with fewer than two GPUs the test moves the CUDA caches' blocks over gloo (staged through the host).
DIST_BACKEND = "nccl" if DEVICE == "cuda" and torch.cuda.device_count() >= 2 else "gloo"


class Pair:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.path = "shm" if backend == "shm-zero-copy" else backend
        zero_copy = backend == "shm-zero-copy"
        self.cache = KVCache(
            SPEC, SENDER_BLOCKS, device="cpu" if zero_copy else DEVICE, shared_memory=zero_copy
        )
        self.alloc = BlockAllocator(SENDER_BLOCKS)
        self.dist_init = None
        if backend == "local":
            self.endpoint = LocalEndpoint("local", SPEC, RECEIVER_BLOCKS, CFG, cache_device=DEVICE)
            self.sender = create_transport("local", self.cache, self.alloc, CFG)
        elif backend in ("grpc", "shm", "shm-zero-copy"):
            self.endpoint = EndpointProcess("grpc", SPEC, RECEIVER_BLOCKS, CFG, cache_device=DEVICE)
            cfg = TransferConfig(**{**CFG.__dict__, "same_node_fast_path": self.path == "shm"})
            self.sender = create_transport(self.path, self.cache, self.alloc, cfg)
        else:
            init = f"tcp://127.0.0.1:{free_port()}"
            self.endpoint = EndpointProcess(
                "torch_dist",
                SPEC,
                RECEIVER_BLOCKS,
                CFG,
                cache_device=f"{DEVICE}:1" if DIST_BACKEND == "nccl" else DEVICE,
                backend=DIST_BACKEND,
                rank=1,
                world_size=2,
                init_method=init,
                peers=[0],
            )
            # Joins the process group with the endpoint (collective: both sides must be up).
            self.sender = create_transport(
                "torch_dist",
                self.cache,
                self.alloc,
                CFG,
                backend=DIST_BACKEND,
                rank=0,
                world_size=2,
                init_method=init,
            )
        self.peer = self.endpoint.wait_ready()

    def blocks(self, num_tokens: int) -> list[int]:
        ids = self.alloc.allocate(SPEC.blocks_for_tokens(num_tokens))
        self.cache.data[:, :, ids] = torch.randn(SPEC.num_layers, 2, len(ids), SPEC.block_size, 2, 8).to(
            self.cache.device
        )
        return ids

    def assert_no_leaks(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.alloc.check_integrity()
            rx = self.endpoint.stats()  # checks the receiver's allocator integrity too
            ok = (
                self.alloc.num_used == 0
                and len(self.sender.leases) == 0
                and rx["used_blocks"] == 0
                and rx["in_flight"] == 0
                and rx["free_blocks"] + rx["used_blocks"] == rx["total_blocks"]
            )
            if ok or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert self.alloc.num_free + self.alloc.num_used == SENDER_BLOCKS
        assert self.alloc.num_used == 0, f"sender leaks {self.alloc.num_used} blocks"
        assert rx["used_blocks"] == 0 and rx["in_flight"] == 0, f"receiver holds blocks: {rx}"

    def close(self) -> None:
        if self.backend == "torch_dist":
            self.sender.say_goodbye(self.peer)
        self.endpoint.close()
        self.sender.close()
        if self.backend == "torch_dist" and dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request):
    p = Pair(request.param)
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _reset_faults(request):
    yield
    if "pair" in request.fixturenames:
        p = request.getfixturevalue("pair")
        p.sender.faults = FaultInjector()


def _expected(p: Pair, ids: list[int], n: int) -> torch.Tensor:
    return gather_tokens(p.cache, ids, n).cpu().clone()  # [L, 2, n, KVH, D]


def test_roundtrip_data_handshake_and_metrics(pair: Pair) -> None:
    ids = pair.blocks(37)
    want = _expected(pair, ids, 37)
    m = pair.sender.send(pair.peer, "rt", ids, 37, first_token=1234)
    got = pair.endpoint.receive(10)
    assert got is not None and got["request_id"] == "rt"
    assert got["num_tokens"] == 37 and got["first_token"] == 1234
    assert torch.equal(got["data"], want)
    assert m.status == "ok" and m.bytes > 0 and m.latency_s > 0 and m.chunks > 1 and m.attempts == 1
    assert m.backend == pair.path
    assert pair.sender.metrics()[-1]["throughput_gbps"] > 0
    pair.assert_no_leaks()


def test_prepare_leaves_the_peer_ready_and_never_raises(pair: Pair) -> None:
    # Ahead of the first transfer (a prefill worker learning its decode peers): best effort, idempotent.
    pair.sender.prepare(pair.peer)
    pair.sender.prepare(pair.peer)
    pair.sender.prepare("127.0.0.1:1")  # nothing listens there: its transfers will say so, not this call
    if pair.backend in ("grpc", "shm", "shm-zero-copy"):
        assert pair.peer in pair.sender.stats()["routes"], (
            "the route to the peer is known before any transfer"
        )
    ids = pair.blocks(5)
    assert pair.sender.send(pair.peer, "after-prepare", ids, 5, first_token=1).status == "ok"
    assert pair.endpoint.receive(10) is not None
    pair.assert_no_leaks()


def test_layer_by_layer_streaming_overlaps_writes(pair: Pair) -> None:
    ids = pair.blocks(21)
    pair.cache.data[:, :, ids] = 0.0
    pair.sender.begin_send(pair.peer, "layers", ids, 21, first_token=5)
    for layer in range(SPEC.num_layers):
        # The runner writes layer i, then hands it over while computing layer i + 1.
        pair.cache.data[layer, :, ids] = float(layer + 1)
        pair.sender.send_layer("layers", layer)
    want = _expected(pair, ids, 21)
    pair.sender.finish("layers")
    got = pair.endpoint.receive(10)
    assert torch.equal(got["data"], want)
    assert got["data"][2].unique().tolist() == [3.0]
    pair.assert_no_leaks()


def test_one_transaction_the_handshake_reserves_and_the_commit_comes_with_the_kv(pair: Pair) -> None:
    # The handshake carries the room the request may grow to on the receiver; the commit, sent last, what the
    # receiver runs the request on. Both come out with the KV, and nothing is handed over before the commit.
    ids = pair.blocks(21)
    want = _expected(pair, ids, 21)
    pair.sender.begin_send(pair.peer, "txn", ids, 21, first_token=-1, reserve_tokens=85)
    for layer in range(SPEC.num_layers):
        pair.sender.send_layer("txn", layer)
    assert pair.endpoint.receive(0.3) is None  # every layer is there, the commit is not: nothing handed over
    commit = bytes(range(256)) * 3  # any bytes, zeros included
    pair.sender.finish("txn", commit)
    got = pair.endpoint.receive(10)
    assert got["request_id"] == "txn" and got["commit"] == commit and got["reserve_tokens"] == 85
    assert torch.equal(got["data"], want)
    pair.assert_no_leaks()


def test_a_retried_transfer_carries_its_commit_again(pair: Pair) -> None:
    ids = pair.blocks(30)
    pair.sender.faults = FaultInjector(corrupt_attempts=1, corrupt_seq=2)
    m = pair.sender.send(
        pair.peer, "txn-retry", ids, 30, first_token=2, commit=b"prefilled", reserve_tokens=40
    )
    assert m.attempts == 2
    got = pair.endpoint.receive(10)
    assert got["commit"] == b"prefilled" and got["reserve_tokens"] == 40
    pair.assert_no_leaks()


def test_a_reservation_the_receiver_has_no_room_for_is_full_and_holds_nothing(pair: Pair) -> None:
    pair.endpoint.admit_up_to(64)
    try:
        ids = pair.blocks(20)  # the KV itself fits; the room to finish it does not
        with pytest.raises(KVTransferError) as e:
            pair.sender.send(pair.peer, "no-room", ids, 20, first_token=1, commit=b"x", reserve_tokens=65)
        assert e.value.receiver_full and "no room" in e.value.detail
        pair.assert_no_leaks()
        ids = pair.blocks(20)
        pair.sender.send(pair.peer, "room", ids, 20, first_token=1, commit=b"x", reserve_tokens=64)
        assert pair.endpoint.receive(10)["request_id"] == "room"
    finally:
        pair.endpoint.admit_up_to(None)
    pair.assert_no_leaks()


def test_receiver_full_is_reported_and_nothing_leaks(pair: Pair) -> None:
    n = (RECEIVER_BLOCKS + 1) * SPEC.block_size
    ids = pair.alloc.allocate(SPEC.blocks_for_tokens(n)) if n <= SENDER_BLOCKS * SPEC.block_size else None
    assert ids is not None
    with pytest.raises(KVTransferError) as e:
        pair.sender.send(pair.peer, "full", ids, n, first_token=1)
    assert e.value.status is TransferStatus.FULL and e.value.receiver_full
    pair.assert_no_leaks()


def test_corrupted_chunk_is_rejected_and_retried_once(pair: Pair) -> None:
    ids = pair.blocks(30)
    want = _expected(pair, ids, 30)
    pair.sender.faults = FaultInjector(corrupt_attempts=1, corrupt_seq=3)
    m = pair.sender.send(pair.peer, "crc1", ids, 30, first_token=2)
    assert m.attempts == 2
    got = pair.endpoint.receive(10)
    assert torch.equal(got["data"], want)
    pair.assert_no_leaks()


def test_corruption_beyond_retries_fails_for_recompute(pair: Pair) -> None:
    ids = pair.blocks(30)
    pair.sender.faults = FaultInjector(corrupt_attempts=5, corrupt_seq=0)
    with pytest.raises(KVTransferError) as e:
        pair.sender.send(pair.peer, "crc2", ids, 30, first_token=2)
    assert e.value.status is TransferStatus.CHECKSUM
    assert pair.endpoint.receive(0.3) is None  # never handed to decode
    pair.assert_no_leaks()


def test_truncated_stream_is_detected_and_retried(pair: Pair) -> None:
    ids = pair.blocks(30)
    want = _expected(pair, ids, 30)
    pair.sender.faults = FaultInjector(truncate_attempts=1)
    m = pair.sender.send(pair.peer, "trunc1", ids, 30, first_token=2)
    assert m.attempts == 2
    assert torch.equal(pair.endpoint.receive(10)["data"], want)
    ids = pair.blocks(30)
    pair.sender.faults = FaultInjector(truncate_attempts=9)
    with pytest.raises(KVTransferError) as e:
        pair.sender.send(pair.peer, "trunc2", ids, 30, first_token=2)
    assert e.value.status is TransferStatus.TRUNCATED
    pair.assert_no_leaks()


def test_sender_abort_mid_transfer_frees_both_sides(pair: Pair) -> None:
    ids = pair.blocks(40)
    pair.sender.begin_send(pair.peer, "sab", ids, 40, first_token=1)
    pair.sender.send_layer("sab", 0)
    assert pair.endpoint.stats()["used_blocks"] > 0  # the receiver holds the request's blocks
    assert pair.sender.abort("sab", "client disconnected")
    with pytest.raises(KVTransferError) as e:
        pair.sender.finish("sab")
    assert e.value.status in (TransferStatus.ABORTED, TransferStatus.UNKNOWN)
    pair.assert_no_leaks()
    assert pair.endpoint.receive(0.3) is None


def test_receiver_abort_mid_transfer_reaches_sender(pair: Pair) -> None:
    ids = pair.blocks(40)
    pair.sender.begin_send(pair.peer, "rab", ids, 40, first_token=1)
    pair.sender.send_layer("rab", 0)
    assert pair.endpoint.abort("rab")
    with pytest.raises(KVTransferError) as e:
        pair.sender.finish("rab")
    assert e.value.status is TransferStatus.ABORTED
    pair.assert_no_leaks()


def test_a_handshake_after_a_final_abort_on_the_receiver_is_refused(pair: Pair) -> None:
    # The decode worker gave the request up (its prefill worker died) before that worker's handshake, sent just
    # before its death, was read: the late handshake must not reserve blocks that nobody will take.
    assert not pair.endpoint.abort("gone", True)  # nothing held yet
    ids = pair.blocks(20)
    with pytest.raises(KVTransferError) as e:
        pair.sender.begin_send(pair.peer, "gone", ids, 20, first_token=1)
    assert e.value.status is TransferStatus.ABORTED and not e.value.receiver_full
    pair.assert_no_leaks()  # the sender's transport freed the blocks it was given
    # A plain abort (a transfer cancelled to be retried) refuses nothing: the retry is served.
    ids = pair.blocks(20)
    pair.sender.begin_send(pair.peer, "again", ids, 20, first_token=1)
    assert pair.sender.abort("again", "retry elsewhere")
    with pytest.raises(KVTransferError):
        pair.sender.finish("again")
    ids = pair.blocks(20)
    pair.sender.send(pair.peer, "again", ids, 20, first_token=1)
    got = pair.endpoint.receive(10)
    assert got is not None and got["request_id"] == "again"
    pair.assert_no_leaks()


def test_sender_lease_expires_without_ack(pair: Pair) -> None:
    ids = pair.blocks(12)
    pair.sender.leases.ttl_s = 0.2
    try:
        pair.sender.begin_send(pair.peer, "lease", ids, 12, first_token=1)
        # Never finished (a prefill worker that died mid-way): the TTL frees the sender's blocks and
        # tells the receiver, which frees its own.
        pair.assert_no_leaks(timeout=5)
    finally:
        pair.sender.leases.ttl_s = CFG.lease_ttl_s
    with pytest.raises(KVTransferError):
        pair.sender.finish("lease")
    pair.assert_no_leaks()


def test_abort_after_receipt_frees_blocks_not_yet_taken(pair: Pair) -> None:
    ids = pair.blocks(9)
    pair.sender.send(pair.peer, "late", ids, 9, first_token=1)
    assert pair.endpoint.abort("late")  # client left before decode admitted it
    assert pair.endpoint.receive(0.3) is None
    pair.assert_no_leaks()


def test_bad_block_count_is_refused_before_anything_is_leased(pair: Pair) -> None:
    ids = pair.blocks(8)
    with pytest.raises(ValueError, match="expected 3"):
        pair.sender.send(pair.peer, "bad", ids, 9, first_token=1)
    pair.alloc.free(ids)
    pair.assert_no_leaks()


@pytest.mark.parametrize("backend", ["local", "grpc"])
@pytest.mark.parametrize("receiver_block_size", [16, 1])
def test_reblocking_on_receipt(backend: str, receiver_block_size: int) -> None:
    rspec = KVCacheSpec(**{**SPEC.__dict__, "block_size": receiver_block_size})
    cls = LocalEndpoint if backend == "local" else EndpointProcess
    endpoint = cls(backend, rspec, 200, CFG)
    cache, alloc = KVCache(SPEC, SENDER_BLOCKS), BlockAllocator(SENDER_BLOCKS)
    sender = create_transport(
        backend, cache, alloc, TransferConfig(**{**CFG.__dict__, "same_node_fast_path": False})
    )
    try:
        peer = endpoint.wait_ready()
        ids = alloc.allocate(SPEC.blocks_for_tokens(45))
        cache.data[:, :, ids] = torch.randn(SPEC.num_layers, 2, len(ids), SPEC.block_size, 2, 8)
        want = gather_tokens(cache, ids, 45).clone()
        sender.send(peer, "rb", ids, 45, first_token=9)
        got = endpoint.receive(10)
        assert got is not None and len(got["block_ids"]) == rspec.blocks_for_tokens(45)
        assert torch.equal(got["data"], want)
        assert alloc.num_used == 0 and endpoint.stats()["used_blocks"] == 0
    finally:
        sender.close()
        endpoint.close()


@pytest.mark.parametrize("backend", ["local", "grpc"])
def test_fingerprint_mismatch_is_refused(backend: str) -> None:
    other = KVCacheSpec(**{**SPEC.__dict__, "num_layers": 4})
    cls = LocalEndpoint if backend == "local" else EndpointProcess
    endpoint = cls(backend, other, 32, CFG)
    cache, alloc = KVCache(SPEC, 16), BlockAllocator(16)
    sender = create_transport(
        backend, cache, alloc, TransferConfig(**{**CFG.__dict__, "same_node_fast_path": False})
    )
    try:
        peer = endpoint.wait_ready()
        with pytest.raises(KVTransferError) as e:
            sender.send(peer, "fp", alloc.allocate(2), 8, first_token=1)
        assert e.value.status is TransferStatus.MISMATCH and "num_layers" in e.value.detail
        assert alloc.num_used == 0 and endpoint.stats()["used_blocks"] == 0
    finally:
        sender.close()
        endpoint.close()


@pytest.mark.parametrize("backend", ["local", "grpc"])
def test_receiver_frees_a_transfer_whose_sender_went_silent(backend: str) -> None:
    rcfg = TransferConfig(**{**CFG.__dict__, "receive_timeout_s": 0.3})
    cls = LocalEndpoint if backend == "local" else EndpointProcess
    endpoint = cls(backend, SPEC, 32, rcfg)
    cache, alloc = KVCache(SPEC, 16), BlockAllocator(16)
    sender = create_transport(
        backend, cache, alloc, TransferConfig(**{**CFG.__dict__, "same_node_fast_path": False})
    )
    try:
        peer = endpoint.wait_ready()
        sender.begin_send(peer, "silent", alloc.allocate(3), 12, first_token=1)
        sender.send_layer("silent", 0)
        assert endpoint.stats()["used_blocks"] == 3
        deadline = time.monotonic() + 5
        while endpoint.stats()["used_blocks"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert endpoint.stats()["used_blocks"] == 0
        sender.abort("silent")
        assert alloc.num_used == 0
    finally:
        sender.close()
        endpoint.close()


def test_wake_ends_a_waiting_take_at_once() -> None:
    # The decode worker waits long for a hand-off while idle; its other work (a lent batch, an abort) wakes it.
    cache = KVCache(SPEC, 8, device="cpu")
    transport = create_transport("local", cache, BlockAllocator(8), CFG)
    try:
        timer = threading.Timer(0.2, transport.receiver.wake)
        timer.start()
        t0 = time.monotonic()
        assert transport.receive(30.0) is None
        assert time.monotonic() - t0 < 10.0, "the wake did not end the wait"
        assert transport.receive(0.05) is None, "one wake ends one wait"
    finally:
        transport.close()
