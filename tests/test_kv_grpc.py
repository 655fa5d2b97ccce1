"""gRPC-only behaviour: token auth, parallel streams, automatic same-node fast path, registry."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from bench.kv_endpoint import LocalEndpoint, gather_tokens
from engine.block_allocator import BlockAllocator
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import KVTransferError, TransferConfig, TransferStatus, create_transport, transport_names

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


def _self_signed(tmp_path, san: str = "IP:127.0.0.1,DNS:localhost") -> tuple[str, str]:
    """A certificate for ``san`` (by default 127.0.0.1) made by the openssl binary (no network, no extra Python
    package)."""
    import subprocess

    cert, key = tmp_path / "kv.pem", tmp_path / "kv.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", f"subjectAltName={san}", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


def test_tls_with_a_configured_certificate_and_refusal_without_it(tmp_path) -> None:
    cert, key = _self_signed(tmp_path)
    rx = LocalEndpoint(
        "grpc", SPEC, 32, TransferConfig(**BASE, tls_cert_file=cert, tls_key_file=key, auth_token="t0k")
    )
    cache, alloc, tls = _sender(tls_ca_file=cert, auth_token="t0k", same_node_fast_path=False)
    _, alloc2, plain = _sender(auth_token="t0k", same_node_fast_path=False, rpc_timeout_s=2.0)
    try:
        ids = alloc.allocate(SPEC.blocks_for_tokens(30))
        want = gather_tokens(cache, ids, 30).clone()
        m = tls.send(rx.address, "tls", ids, 30, first_token=5)
        assert m.status == "ok" and m.backend == "grpc"
        got = rx.receive(5)
        assert got["request_id"] == "tls" and torch.equal(got["data"], want)
        # A plaintext client cannot talk to the TLS endpoint: refused, and its blocks come back.
        with pytest.raises(KVTransferError) as e:
            plain.send(rx.address, "plain", alloc2.allocate(2), 8, first_token=1)
        assert e.value.status in (TransferStatus.UNAVAILABLE, TransferStatus.TIMEOUT)
        assert alloc.num_used == 0 and alloc2.num_used == 0
        assert rx.stats()["used_blocks"] == 0
    finally:
        tls.close()
        plain.close()
        rx.close()


def test_sender_blocks_instead_of_buffering_when_the_receiver_stalls(monkeypatch) -> None:
    # The receiver stops writing; the sender must stop producing chunks after a bounded number (its queue of
    # max_inflight_chunks plus what gRPC's flow-control windows hold), not encode the whole transfer into memory.
    import threading
    import time

    from kv_transfer import grpc_sessions, receiver

    gate = threading.Event()
    real_write = receiver.KVReceiver.write

    def stalled_write(self, info, payload, attempt=None):
        gate.wait(30)
        return real_write(self, info, payload, attempt)

    encoded = []
    real_encode = grpc_sessions.encode_chunk

    def counting_encode(header, views=()):
        encoded.append(1)
        return real_encode(header, views)

    monkeypatch.setattr(receiver.KVReceiver, "write", stalled_write)
    monkeypatch.setattr(grpc_sessions, "encode_chunk", counting_encode)
    spec = KVCacheSpec(
        architecture="LlamaForCausalLM", num_layers=4, num_kv_heads=4, head_dim=64, block_size=16
    )
    per_block = spec.bytes_per_block // (2 * spec.num_layers)  # one block of one layer's K: 16 KiB
    cfg = TransferConfig(
        chunk_bytes=64 * per_block,  # 1 MiB chunks
        max_message_bytes=8 << 20,
        max_inflight_chunks=2,
        num_streams=1,
        rpc_timeout_s=30.0,
        same_node_fast_path=False,
    )
    rx = LocalEndpoint("grpc", spec, 1100, cfg)
    cache, alloc = KVCache(spec, 1100), BlockAllocator(1100)
    tx = create_transport("grpc", cache, alloc, cfg)
    ids = alloc.allocate(1024)  # 16K tokens: 8 layer-KV x 16 chunks = 128 chunks of 1 MiB
    result: dict = {}
    sender = threading.Thread(
        target=lambda: result.update(m=tx.send(rx.address, "bp", ids, 1024 * 16, first_token=1))
    )
    try:
        sender.start()
        time.sleep(1.5)
        held = len(encoded)
        assert sender.is_alive(), "the sender finished although the receiver wrote nothing"
        assert held <= 2 + 1 + 16, f"sender produced {held} of 128 chunks while the receiver was stalled"
        gate.set()
        sender.join(30)
        assert result["m"].status == "ok" and result["m"].chunks == 128
        assert rx.receive(10)["num_tokens"] == 1024 * 16
        assert alloc.num_used == 0 and rx.stats()["used_blocks"] == 0
    finally:
        gate.set()
        sender.join(30)
        tx.close()
        rx.close()


def _end_cleanly(session) -> None:
    for stream in session.streams:  # the request streams end without a cancel: the receiver sees a clean end
        stream.close()


@pytest.mark.parametrize("end", ["cancelled", "ended cleanly"])
def test_a_broken_stream_of_an_earlier_attempt_leaves_the_retry_alone(end: str) -> None:
    # A retry's handshake replaces the failed attempt on the receiver; the old attempt's streams are cancelled by
    # the sender and their end can reach the receiver after that handshake. It used to end the retry too (seen
    # as "stream broken" on a retry after a checksum failure). A cancelled stream can also reach the receiver as
    # a clean end (its request stream closed before the cancel went out): that used to be counted as one of the
    # retry's streams ending, which truncated the retry once the old attempt's streams had all ended.
    from kv_transfer.types import Handshake

    rx = LocalEndpoint("grpc", SPEC, 64, TransferConfig(**BASE))
    cache, alloc, tx = _sender(num_streams=2, same_node_fast_path=False)

    def handshake(attempt: int) -> Handshake:
        return Handshake(
            request_id="retried",
            fingerprint=SPEC.fingerprint(),
            sender_block_size=SPEC.block_size,
            num_tokens=8,
            first_token=1,
            num_chunks=4,
            attempt=attempt,
            num_streams=2,
        )

    try:
        first, old = tx._connect(rx.address, handshake(1))
        assert first.status is TransferStatus.OK and old is not None
        second, new = tx._connect(rx.address, handshake(2))
        assert second.status is TransferStatus.OK and new is not None
        # The first attempt's streams end on the receiver now, after the retry's handshake.
        if end == "cancelled":
            old.cancel()
        else:
            _end_cleanly(old)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # give the receiver time to see the broken streams
            time.sleep(0.05)
        stats = rx.stats()
        assert stats["in_flight"] == 1, f"the retry was ended by its predecessor's broken stream: {stats}"
        new.cancel()
        deadline = time.monotonic() + 5.0
        while rx.stats()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rx.stats()["in_flight"] == 0 and rx.stats()["used_blocks"] == 0
    finally:
        tx.close()
        rx.close()


def test_a_new_send_of_an_aborted_request_is_not_ended_by_the_old_sends_late_stream() -> None:
    # A send aborted to be retried, then sent again to the same peer under the same request id: the aborted
    # send's cancelled streams can reach the receiver after the new handshake. Both sends used to carry attempt
    # 1, so the receiver took the late "stream broken" for the new send's and ended it.
    rx = LocalEndpoint("grpc", SPEC, 64, TransferConfig(**BASE))
    cache, alloc, tx = _sender(num_streams=2, same_node_fast_path=False)
    try:
        tx.begin_send(rx.address, "again", alloc.allocate(3), 12, first_token=1)
        old = tx._outbound["again"].session
        late_cancel = old.cancel
        old.cancel = lambda: None  # the old streams end on the receiver only later, below
        assert tx.abort("again", "retry elsewhere")
        with pytest.raises(KVTransferError):
            tx.finish("again")
        ids = alloc.allocate(3)
        want = gather_tokens(cache, ids, 12).clone()
        tx.begin_send(rx.address, "again", ids, 12, first_token=1)
        late_cancel()
        time.sleep(0.5)  # give the receiver time to see the old streams break
        tx.finish("again")
        got = rx.receive(5)
        assert got is not None and torch.equal(got["data"], want)
        assert alloc.num_used == 0 and rx.stats()["used_blocks"] == 0
    finally:
        tx.close()
        rx.close()
