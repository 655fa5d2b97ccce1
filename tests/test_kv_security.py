"""The KV endpoint's defences, over real gRPC: segment names from a peer are ours or refused (never opened), the
mapped segments are bounded, a call without the token reserves nothing and learns nothing, a non-loopback
listener needs TLS."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from test_kv_grpc import BASE, SPEC, _self_signed, _sender

from bench.kv_endpoint import LocalEndpoint, gather_tokens
from engine.shm_segment import SEGMENT_PREFIX, create_segment, is_segment_name
from kv_transfer import KVTransferError, TransferConfig, TransferStatus
from kv_transfer.grpc_codes import RID_KEY, SERVICE
from kv_transfer.shm import ShmAttachments, node_id
from kv_transfer.wire import encode_chunk, fingerprint_pb
from proto import kv_transfer_pb2 as pb

TOKEN = "cluster-token-0123456789"


@pytest.fixture
def endpoint():
    ep = LocalEndpoint("grpc", SPEC, 32, TransferConfig(**BASE))
    yield ep
    ep.close()


@pytest.fixture
def prober():
    _, _, tx = _sender(same_node_fast_path=False)
    yield tx
    tx.close()


def test_a_parent_path_probe_is_refused_not_opened(endpoint, prober, tmp_path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"x" * 4096)
    reply = prober.peer_stats(endpoint.address, shm_probe="../.." + str(target))
    assert reply.shm_ok is False
    assert len(endpoint.t._service.segments) == 0


@pytest.mark.parametrize(
    "name",
    [
        "x" * 5000,
        "/" + SEGMENT_PREFIX + "0123456789abcdef",
        SEGMENT_PREFIX + "0123456789abcdef/..",
        SEGMENT_PREFIX + "0123456789abcdeg",
        SEGMENT_PREFIX + "0123456789abcdef0",
        SEGMENT_PREFIX + "0123456789abcde\x00",
        "psm_0123abcd",
        "..",
    ],
)
def test_odd_or_oversized_names_are_refused(endpoint, prober, name: str) -> None:
    assert not is_segment_name(name)
    assert prober.peer_stats(endpoint.address, shm_probe=name).shm_ok is False
    assert len(endpoint.t._service.segments) == 0


def test_a_link_under_our_name_is_not_followed(endpoint, prober, tmp_path) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    target = tmp_path / "victim"
    target.write_bytes(b"x" * 4096)
    link = Path("/dev/shm") / (SEGMENT_PREFIX + os.urandom(8).hex())
    link.symlink_to(target)
    try:
        assert prober.peer_stats(endpoint.address, shm_probe=link.name).shm_ok is False
    finally:
        link.unlink()


def test_our_own_segment_is_probed_and_mapped(endpoint, prober) -> None:
    seg = create_segment(4096)
    try:
        assert is_segment_name(seg.name)
        assert prober.peer_stats(endpoint.address, shm_probe=seg.name).shm_ok is True
        # A well-formed name of no segment: refused, and nothing kept.
        missing = SEGMENT_PREFIX + "0" * 16
        assert prober.peer_stats(endpoint.address, shm_probe=missing).shm_ok is False
        assert len(endpoint.t._service.segments) == 1
    finally:
        seg.close()
        seg.unlink()


def test_mapped_segments_are_bounded_least_recently_used_first() -> None:
    attachments = ShmAttachments(max_segments=2)
    segs = [create_segment(4096) for _ in range(4)]
    try:
        for s in segs:
            s.buf[0] = 7
            assert attachments.get(s.name).buf[0] == 7
            assert len(attachments) <= 2
        attachments.get(segs[2].name)  # the most recent again: segs[3] goes next, not it
        attachments.get(segs[0].name)
        assert len(attachments) == 2
        with pytest.raises(KVTransferError, match="refused shared-memory segment name"):
            attachments.get("../../etc/passwd")
    finally:
        attachments.close()
        for s in segs:
            s.close()
            s.unlink()


def _handshake_request(rid: str, num_tokens: int = 32) -> pb.HandshakeRequest:
    return pb.HandshakeRequest(
        request_id=rid,
        fingerprint=fingerprint_pb(SPEC.fingerprint()),
        sender_block_size=SPEC.block_size,
        num_tokens=num_tokens,
        first_token=1,
        num_chunks=4,
        attempt=1,
        num_streams=1,
    )


def _call(address: str, method: str, request, reply_cls, metadata=()):
    with grpc.insecure_channel(address) as ch:
        rpc = ch.unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=reply_cls.FromString,
        )
        return rpc(request, timeout=10, metadata=list(metadata))


@pytest.mark.parametrize(
    "metadata",
    [
        [],
        [("authorization", "Bearer wrong")],
        [("authorization", TOKEN)],
        [("authorization", f"Bearer {TOKEN}x")],
    ],
    ids=["missing", "wrong", "no-bearer", "longer"],
)
def test_a_handshake_without_the_token_reserves_nothing(metadata) -> None:
    ep = LocalEndpoint("grpc", SPEC, 32, TransferConfig(**BASE, auth_token=TOKEN))
    try:
        free = ep.stats()["free_blocks"]
        for method, request, reply in [
            ("Handshake", _handshake_request("steal"), pb.HandshakeReply),
            ("Stats", pb.StatsRequest(shm_probe="../../etc/passwd"), pb.StatsReply),
            ("Abort", pb.AbortRequest(request_id="steal"), pb.AbortReply),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                _call(ep.address, method, request, reply, metadata)
            assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED, method
            assert e.value.details() == "missing or bad token"  # nothing about the receiver
        assert ep.stats()["free_blocks"] == free
        assert ep.stats()["in_flight"] == 0
        # The same handshake with the token does reserve (so the refusal above is the token's doing).
        auth = [("authorization", f"Bearer {TOKEN}")]
        ok = _call(ep.address, "Handshake", _handshake_request("mine"), pb.HandshakeReply, auth)
        assert ok.status == pb.HandshakeReply.ACCEPTED
        assert ep.stats()["free_blocks"] == free - SPEC.blocks_for_tokens(32)
        assert _call(ep.address, "Abort", pb.AbortRequest(request_id="mine"), pb.AbortReply, auth).found
        assert ep.stats()["free_blocks"] == free
    finally:
        ep.close()


def test_a_chunk_header_naming_a_foreign_file_fails_the_transfer_and_frees_its_blocks(
    endpoint, tmp_path
) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"x" * 4096)
    free = endpoint.stats()["free_blocks"]
    ok = _call(endpoint.address, "Handshake", _handshake_request("forged"), pb.HandshakeReply)
    assert ok.status == pb.HandshakeReply.ACCEPTED
    header = pb.ChunkHeader(
        request_id="forged",
        seq=0,
        layer=0,
        kv=0,
        first_block=0,
        num_blocks=1,
        nbytes=64,
        shm_name="../.." + str(target),
    )
    with grpc.insecure_channel(endpoint.address) as ch:
        rpc = ch.stream_stream(
            f"/{SERVICE}/SharedMemoryTransfer",
            request_serializer=lambda b: b,
            response_deserializer=pb.SlotRelease.FromString,
        )
        replies = list(rpc(iter([encode_chunk(header)]), timeout=10, metadata=[(RID_KEY, "forged")]))
    assert len(replies) == 1 and replies[0].HasField("ack")
    assert replies[0].ack.status == pb.TransferAck.INVALID
    assert "refused shared-memory segment name" in replies[0].ack.detail
    assert endpoint.stats()["free_blocks"] == free
    assert len(endpoint.t._service.segments) == 0


def test_the_node_id_tells_nothing_about_the_host() -> None:
    import socket

    nid = node_id()
    assert socket.gethostname() not in nid and len(nid) == 32
    assert node_id() == nid


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"host": "0.0.0.0"},
            "TransferConfig.host 0.0.0.0 is not a loopback address: serving KV there needs TLS",
        ),
        ({"host": "10.1.2.3"}, "TransferConfig.host 10.1.2.3 is not a loopback address"),
        ({"host": "kv.example"}, "TransferConfig.host kv.example is not a loopback address"),
        ({"host": ""}, "TransferConfig.host must be an address or host name"),
        ({"auth_token": ""}, "TransferConfig.auth_token must be a non-empty string"),
        ({"auth_token": "two words"}, "TransferConfig.auth_token must be printable ASCII without spaces"),
        ({"auth_token": "line\nbreak"}, "TransferConfig.auth_token must be printable ASCII without spaces"),
        ({"auth_token": "x" * 1025}, "TransferConfig.auth_token must be at most 1024 characters"),
        ({"max_shm_segments": 0}, "TransferConfig.max_shm_segments must be > 0"),
    ],
)
def test_transfer_config_refuses_unsafe_settings(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        TransferConfig(**fields)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_hosts_need_no_tls(host: str) -> None:
    assert TransferConfig(host=host).host == host


def test_every_address_with_tls_and_the_token_carries_kv(tmp_path) -> None:
    cert, key = _self_signed(tmp_path)
    cfg = TransferConfig(**BASE, host="0.0.0.0", tls_cert_file=cert, tls_key_file=key, auth_token=TOKEN)
    rx = LocalEndpoint("grpc", SPEC, 32, cfg, advertise_host="127.0.0.1")
    cache, alloc, tx = _sender(tls_ca_file=cert, auth_token=TOKEN, same_node_fast_path=False)
    try:
        assert rx.address.startswith("127.0.0.1:")
        ids = alloc.allocate(SPEC.blocks_for_tokens(20))
        want = gather_tokens(cache, ids, 20).clone()
        assert tx.send(rx.address, "wide", ids, 20, first_token=2).status == "ok"
        got = rx.receive(5)
        assert got["request_id"] == "wide" and (got["data"] == want).all()
    finally:
        tx.close()
        rx.close()


def test_one_certificate_for_every_node_by_server_name(tmp_path) -> None:
    """A certificate made out to a name, not an address: a sender told that name (tls_server_name) checks it
    against the name and gets through; one checking it against the address it dials is refused."""
    cert, key = _self_signed(tmp_path, san="DNS:bucketserve-kv")
    cfg = TransferConfig(**BASE, host="0.0.0.0", tls_cert_file=cert, tls_key_file=key, auth_token=TOKEN)
    rx = LocalEndpoint("grpc", SPEC, 32, cfg, advertise_host="127.0.0.1")
    common = {"tls_ca_file": cert, "auth_token": TOKEN, "same_node_fast_path": False}
    cache, alloc, named = _sender(tls_server_name="bucketserve-kv", **common)
    _, alloc2, by_address = _sender(rpc_timeout_s=2.0, **common)
    try:
        ids = alloc.allocate(SPEC.blocks_for_tokens(20))
        want = gather_tokens(cache, ids, 20).clone()
        assert named.send(rx.address, "named", ids, 20, first_token=2).status == "ok"
        got = rx.receive(5)
        assert got["request_id"] == "named" and (got["data"] == want).all()
        assert named.stats()["routes"] == {rx.address: "grpc+tls"}
        with pytest.raises(KVTransferError, match="Hostname Verification"):
            by_address.send(
                rx.address, "by-address", alloc2.allocate(SPEC.blocks_for_tokens(20)), 20, first_token=2
            )
    finally:
        named.close()
        by_address.close()
        rx.close()


def test_a_server_name_needs_tls() -> None:
    with pytest.raises(ValueError, match="tls_server_name needs TLS"):
        TransferConfig(tls_server_name="bucketserve-kv")


def test_a_transport_told_to_listen_widely_without_tls_refuses() -> None:
    from engine.block_allocator import BlockAllocator
    from engine.kv_cache import KVCache
    from kv_transfer import create_transport

    t = create_transport("grpc", KVCache(SPEC, 4), BlockAllocator(4), TransferConfig(**BASE), host="0.0.0.0")
    try:
        with pytest.raises(KVTransferError) as e:
            t.serve()
        assert e.value.status is TransferStatus.INVALID and "without TLS" in e.value.detail
    finally:
        t.close()
