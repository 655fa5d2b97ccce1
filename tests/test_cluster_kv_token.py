"""A launched cluster's KV endpoints are authenticated: its workers hand KV over with the cluster's token, and a
caller without it (or with another) is refused by a running decode worker and reserves nothing there."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from cluster_helpers import cluster_config, collect, make_request, wait_idle

from gateway.cluster_backend import RayClusterBackend
from kv_transfer.grpc_codes import SERVICE
from proto import kv_transfer_pb2 as pb

pytestmark = pytest.mark.slow


def _call(address: str, method: str, request, reply_cls, token: str | None):
    metadata = [("authorization", f"Bearer {token}")] if token is not None else []
    with grpc.insecure_channel(address) as ch:
        rpc = ch.unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=reply_cls.FromString,
        )
        return rpc(request, timeout=10, metadata=metadata)


def test_workers_use_a_cluster_token_and_refuse_callers_without_it(ray_session):
    config = cluster_config("disaggregated", "t-kvtoken")
    assert config.transfer.auth_token is None  # none given: the launcher makes one
    backend = RayClusterBackend(config)
    try:
        token = backend.handles.config.transfer.auth_token
        assert token and len(token) >= 32
        # Prefill hands KV to decode with it: a request completes.
        got = asyncio.run(collect(backend, make_request("tok-0", 40, 4)))
        assert got.error is None and len(got.tokens) == 4
        asyncio.run(wait_idle(backend))

        (name,) = backend.handles.by_role("decode")
        address = backend.handles.infos[name].address
        assert address.startswith("127.0.0.1:")
        stats = _call(address, "Stats", pb.StatsRequest(), pb.StatsReply, token)
        free = stats.free_blocks
        assert stats.total_blocks == free + stats.used_blocks > 0

        # The interceptor answers before the service reads anything of the request.
        steal = pb.HandshakeRequest(request_id="steal", num_tokens=64, num_chunks=1, attempt=1, num_streams=1)
        for bad in (None, "wrong", token + "x"):
            for method, request, reply in [
                ("Stats", pb.StatsRequest(), pb.StatsReply),
                ("Handshake", steal, pb.HandshakeReply),
                ("Abort", pb.AbortRequest(request_id="tok-0"), pb.AbortReply),
            ]:
                with pytest.raises(grpc.RpcError) as e:
                    _call(address, method, request, reply, bad)
                assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED, (method, bad)
        after = _call(address, "Stats", pb.StatsRequest(), pb.StatsReply, token)
        assert (after.free_blocks, after.in_flight) == (free, 0)
    finally:
        asyncio.run(backend.shutdown())
