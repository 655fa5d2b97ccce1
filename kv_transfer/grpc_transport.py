"""``grpc`` (default, across nodes) and ``shm`` (same node) backends, both served by one gRPC
endpoint on the receiver.

Payloads travel as raw bytes: the chunk message is built by hand in protobuf wire form (see
``wire.encode_chunk``) and handed to gRPC with identity serialisers, so no protobuf object ever
holds a payload. With ``same_node_fast_path`` the sender asks the peer for its node id once and,
when both are on one host and the peer can open the sender's shared-memory ring, moves the
payloads through shared memory and only the small headers over gRPC.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent import futures
from pathlib import Path

import grpc

from proto import kv_transfer_pb2 as pb

from .base import KVTransport, SenderSession, register_transport
from .config import is_loopback
from .grpc_codes import ATTEMPT_KEY, HS_TO_STATUS, RID_KEY, SERVICE, rpc_error
from .grpc_service import AuthInterceptor, KVService
from .grpc_sessions import GrpcSession, ShmSession
from .shm import ShmRing, node_id
from .types import Handshake, HandshakeResult, KVTransferError, TransferStatus
from .wire import block_layer_bytes, fingerprint_pb

log = logging.getLogger(__name__)


def _bracketed(host: str) -> str:
    """``host`` as the host part of a gRPC target (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@register_transport("grpc")
class GrpcKVTransport(KVTransport):
    """gRPC backend. ``host``/``port`` say where :meth:`serve` listens (host None: ``config.host``; port 0: any
    free port); ``advertise_host`` is the address peers are told to dial (None: ``host``), needed when ``host``
    is a wildcard such as ``0.0.0.0``. With ``config.same_node_fast_path`` a peer on the same node is reached
    through shared memory."""

    force_shm = False

    def __init__(
        self,
        *args,
        host: str | None = None,
        port: int = 0,
        advertise_host: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.host = host if host is not None else self.config.host
        self.port = port
        self.advertise_host = advertise_host or self.host
        self._server: grpc.Server | None = None
        self._service: KVService | None = None
        self._channels: dict[tuple[str, int], grpc.Channel] = {}
        self._routes: dict[str, str] = {}
        self._ring: ShmRing | None = None

    # -- security ---------------------------------------------------------------------------------
    def metadata(self, request_id: str = "", attempt: int | None = None) -> list[tuple[str, str]]:
        md = [(RID_KEY, request_id)] if request_id else []
        if attempt is not None:
            md.append((ATTEMPT_KEY, str(attempt)))
        if self.config.auth_token:
            md.append(("authorization", f"Bearer {self.config.auth_token}"))
        return md

    def _options(self) -> list[tuple[str, int]]:
        n = self.config.max_message_bytes
        return [
            ("grpc.max_send_message_length", n),
            ("grpc.max_receive_message_length", n),
            # Each parallel stream gets its own connection (and so its own I/O thread).
            ("grpc.use_local_subchannel_pool", 1),
        ]

    # -- server -----------------------------------------------------------------------------------
    def _serve(self) -> str:
        cfg = self.config
        if not is_loopback(self.host) and not (cfg.tls_cert_file and cfg.tls_key_file):
            raise KVTransferError(
                TransferStatus.INVALID,
                f"refusing to serve KV on {self.host} without TLS (not a loopback address)",
            )
        interceptors = [AuthInterceptor(cfg.auth_token)] if cfg.auth_token else []
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kv-rx"),
            options=self._options(),
            interceptors=interceptors,
        )
        self._service = KVService(self)
        self._server.add_generic_rpc_handlers((self._service.handler(),))
        target = f"{_bracketed(self.host)}:{self.port}"
        if cfg.tls_cert_file and cfg.tls_key_file:
            creds = grpc.ssl_server_credentials(
                [(Path(cfg.tls_key_file).read_bytes(), Path(cfg.tls_cert_file).read_bytes())]
            )
            port = self._server.add_secure_port(target, creds)
        else:
            port = self._server.add_insecure_port(target)
        self._server.start()
        return f"{_bracketed(self.advertise_host)}:{port}"

    # -- client -----------------------------------------------------------------------------------
    def channel(self, peer: str, index: int = 0) -> grpc.Channel:
        with self.lock:
            ch = self._channels.get((peer, index))
            if ch is None:
                roots = self.config.tls_ca_file or self.config.tls_cert_file
                if roots:
                    # Without a CA file, a certificate of our own is trusted (a self-signed one shared by the cluster).
                    creds = grpc.ssl_channel_credentials(Path(roots).read_bytes())
                    options = self._options()
                    if self.config.tls_server_name:
                        options = [*options, ("grpc.ssl_target_name_override", self.config.tls_server_name)]
                    ch = grpc.secure_channel(peer, creds, options=options)
                else:
                    ch = grpc.insecure_channel(peer, options=self._options())
                self._channels[(peer, index)] = ch
            return ch

    def _unary(self, peer: str, method: str, request, response_cls, request_id: str = ""):
        call = self.channel(peer).unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        try:
            return call(request, timeout=self.config.rpc_timeout_s, metadata=self.metadata(request_id))
        except grpc.RpcError as e:
            raise rpc_error(e, request_id) from None

    def peer_stats(self, peer: str, shm_probe: str = "") -> pb.StatsReply:
        return self._unary(peer, "Stats", pb.StatsRequest(shm_probe=shm_probe), pb.StatsReply)

    def zero_copy_segment(self) -> str | None:
        """The shared-memory segment of this side's KV cache, when it has one (zero-copy sends)."""
        return getattr(self.cache, "shm_name", None) if self.config.shm_zero_copy else None

    def ring(self) -> ShmRing:
        with self.lock:
            if self._ring is None:
                slot = max(self.config.shm_chunk_bytes, block_layer_bytes(self.cache.spec))
                self._ring = ShmRing(max(self.config.shm_ring_bytes, slot), slot)
            return self._ring

    def route(self, peer: str) -> str:
        """'shm' when the peer shares this node (and can map our ring), else 'grpc'; asked once per peer."""
        with self.lock:
            known = self._routes.get(peer)
        if known is not None:
            return known
        route = "grpc"
        if self.force_shm or self.config.same_node_fast_path:
            ring = self.ring()
            reply = self.peer_stats(peer, shm_probe=ring.name)
            if reply.node_id == node_id() and reply.shm_ok:
                route = "shm"
            elif self.force_shm:
                raise KVTransferError(TransferStatus.UNAVAILABLE, f"peer {peer} cannot map shared memory")
        with self.lock:
            self._routes[peer] = route
        return route

    def prepare(self, peer: str) -> None:
        # The channel's connection and the route probe (one Stats call) cost the first handshake ~20 ms otherwise.
        try:
            self.route(peer)
        except (KVTransferError, grpc.RpcError) as e:
            log.debug("KV peer %s not reachable yet: %s", peer, e)

    def _chunk_bytes(self, peer: str) -> int:
        return self.config.shm_chunk_bytes if self.route(peer) == "shm" else self.config.chunk_bytes

    def _connect(self, peer: str, hs: Handshake) -> tuple[HandshakeResult, SenderSession | None]:
        route = self.route(peer)
        req = pb.HandshakeRequest(
            request_id=hs.request_id,
            fingerprint=fingerprint_pb(hs.fingerprint),
            sender_block_size=hs.sender_block_size,
            num_tokens=hs.num_tokens,
            first_token=hs.first_token,
            num_chunks=hs.num_chunks,
            attempt=hs.attempt,
            # The shared-memory path is one stream: it is bounded by memcpy, not by a socket.
            num_streams=1 if route == "shm" else hs.num_streams,
            reserve_tokens=hs.reserve_tokens,
        )
        reply = self._unary(peer, "Handshake", req, pb.HandshakeReply, hs.request_id)
        result = HandshakeResult(
            HS_TO_STATUS.get(reply.status, TransferStatus.INVALID),
            reply.receiver_block_size,
            reply.num_blocks,
            reply.free_blocks,
            reply.detail,
        )
        if result.status is not TransferStatus.OK:
            return result, None
        if route == "shm":
            return result, ShmSession(self, peer, hs.request_id, self.ring(), hs.attempt)
        return result, GrpcSession(self, peer, hs.request_id, hs.attempt)

    def _abort_remote(self, peer: str, request_id: str, reason: str) -> None:
        self._unary(
            peer, "Abort", pb.AbortRequest(request_id=request_id, reason=reason), pb.AbortReply, request_id
        )

    def stats(self) -> dict:
        # How each decode peer is reached ("shm" or "grpc", "+tls" when the channel is secure): what an operator
        # checks to see that KV between nodes takes the network and KV within one takes shared memory.
        with self.lock:
            routes = dict(self._routes)
        return {**super().stats(), "routes": {p: self.config.route_name(r) for p, r in routes.items()}}

    def _shutdown(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0.5).wait()
            self._server = None
        if self._service is not None:
            self._service.segments.close()
        with self.lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()
        if self._ring is not None:
            with contextlib.suppress(Exception):
                self._ring.close()
            self._ring = None


@register_transport("shm")
class ShmKVTransport(GrpcKVTransport):
    """The same-node fast path on its own (refuses a peer on another node); ``grpc`` picks it
    automatically when it can."""

    force_shm = True
