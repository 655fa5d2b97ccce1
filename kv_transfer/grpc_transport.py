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
import hmac
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

from proto import kv_transfer_pb2 as pb

from .base import KVTransport, SenderSession, register_transport
from .shm import ShmAttachments, ShmRing, node_id
from .types import Handshake, HandshakeResult, KVTransferError, TransferStatus
from .wire import ChunkPlan, block_layer_bytes, decode_chunk, encode_chunk, header_pb, info_from_pb

log = logging.getLogger(__name__)

SERVICE = "bucketserve.kv.KVTransfer"
_RID_KEY = "kv-request-id"
_POLL_S = 0.05

_ACK_TO_STATUS = {
    pb.TransferAck.OK: TransferStatus.OK,
    pb.TransferAck.CHECKSUM: TransferStatus.CHECKSUM,
    pb.TransferAck.TRUNCATED: TransferStatus.TRUNCATED,
    pb.TransferAck.ABORTED: TransferStatus.ABORTED,
    pb.TransferAck.UNKNOWN: TransferStatus.UNKNOWN,
    pb.TransferAck.INVALID: TransferStatus.INVALID,
}
_STATUS_TO_ACK = {v: k for k, v in _ACK_TO_STATUS.items()}
_HS_TO_STATUS = {
    pb.HandshakeReply.ACCEPTED: TransferStatus.OK,
    pb.HandshakeReply.FULL: TransferStatus.FULL,
    pb.HandshakeReply.MISMATCH: TransferStatus.MISMATCH,
    pb.HandshakeReply.INVALID: TransferStatus.INVALID,
    pb.HandshakeReply.DUPLICATE: TransferStatus.DUPLICATE,
}
_STATUS_TO_HS = {v: k for k, v in _HS_TO_STATUS.items()}
_RPC_TO_STATUS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: TransferStatus.TIMEOUT,
    grpc.StatusCode.UNAUTHENTICATED: TransferStatus.UNAUTHENTICATED,
    grpc.StatusCode.CANCELLED: TransferStatus.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: TransferStatus.INVALID,
}


def _rpc_error(e: grpc.RpcError, request_id: str) -> KVTransferError:
    code = e.code() if hasattr(e, "code") else None
    detail = e.details() if hasattr(e, "details") else str(e)
    return KVTransferError(
        _RPC_TO_STATUS.get(code, TransferStatus.UNAVAILABLE), f"{code}: {detail}", request_id
    )


def _ack(status: TransferStatus, request_id: str, detail: str = "", final: bool = True) -> pb.TransferAck:
    code = _STATUS_TO_ACK.get(status, pb.TransferAck.ABORTED)
    if status not in _STATUS_TO_ACK:
        detail = f"{status.value}: {detail}"
    return pb.TransferAck(status=code, request_id=request_id, detail=detail, final=final)


def _identity(b: bytes) -> bytes:
    return b


def _request_id(context: grpc.ServicerContext) -> str:
    return dict(context.invocation_metadata()).get(_RID_KEY, "")


# ---------------------------------------------------------------------------------------------
# server


class _AuthInterceptor(grpc.ServerInterceptor):
    """Refuses (and logs) every call without ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        got = dict(handler_call_details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(got.encode(), self._expected):
            return continuation(handler_call_details)
        log.warning("kv transfer: refused %s: missing or bad token", handler_call_details.method)

        def deny(_request, context: grpc.ServicerContext):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or bad token")

        method = handler_call_details.method.rsplit("/", 1)[-1]
        if method == "Transfer":
            return grpc.stream_unary_rpc_method_handler(deny)
        if method == "SharedMemoryTransfer":
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class _KVService:
    def __init__(self, transport: GrpcKVTransport) -> None:
        self.transport = transport
        self.rx = transport.receiver
        self.segments = ShmAttachments()

    def handshake(self, req: pb.HandshakeRequest, context: grpc.ServicerContext) -> pb.HandshakeReply:
        fp = req.fingerprint
        hs = Handshake(
            request_id=req.request_id,
            fingerprint={
                "architecture": fp.architecture,
                "num_layers": fp.num_layers,
                "num_kv_heads": fp.num_kv_heads,
                "head_dim": fp.head_dim,
                "dtype": fp.dtype,
            },
            sender_block_size=req.sender_block_size,
            num_tokens=req.num_tokens,
            first_token=req.first_token,
            num_chunks=req.num_chunks,
            attempt=req.attempt,
            num_streams=req.num_streams,
        )
        r = self.rx.handshake(hs)
        return pb.HandshakeReply(
            status=_STATUS_TO_HS.get(r.status, pb.HandshakeReply.INVALID),
            receiver_block_size=r.receiver_block_size,
            num_blocks=r.num_blocks,
            free_blocks=r.free_blocks,
            detail=r.detail,
        )

    def transfer(self, chunks: Iterator, context: grpc.ServicerContext) -> pb.TransferAck:
        rid = _request_id(context)
        try:
            for header, payload in chunks:
                if header.request_id != rid:
                    raise KVTransferError(
                        TransferStatus.INVALID, "chunk of another request on this stream", rid
                    )
                self.rx.write(info_from_pb(header), payload)
            status, final, detail = self.rx.end_stream(rid)
            return _ack(status, rid, detail, final)
        except KVTransferError as e:
            return _ack(e.status, rid, e.detail)
        except Exception as e:  # the stream broke (sender cancelled or died): free what arrived
            self.rx.fail(rid, TransferStatus.ABORTED, f"stream broken: {e!r}")
            return _ack(TransferStatus.ABORTED, rid, "stream broken")

    def shm_transfer(self, chunks: Iterator, context: grpc.ServicerContext) -> Iterator[pb.SlotRelease]:
        rid = _request_id(context)
        try:
            for header, _ in chunks:
                seg = self.segments.get(header.shm_name)
                payload = seg.buf[header.shm_offset : header.shm_offset + header.nbytes]
                if header.request_id != rid or len(payload) != header.nbytes:
                    raise KVTransferError(TransferStatus.INVALID, "bad shared-memory chunk header", rid)
                self.rx.write(info_from_pb(header), payload)
                if header.release_slot:  # an in-place read needs no answer: one message less per chunk
                    yield pb.SlotRelease(shm_offset=header.shm_offset, shm_name=header.shm_name)
            status, final, detail = self.rx.end_stream(rid)
            yield pb.SlotRelease(ack=_ack(status, rid, detail, final))
        except KVTransferError as e:
            yield pb.SlotRelease(ack=_ack(e.status, rid, e.detail))
        except Exception as e:
            self.rx.fail(rid, TransferStatus.ABORTED, f"stream broken: {e!r}")

    def abort(self, req: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortReply:
        return pb.AbortReply(found=self.transport.abort(req.request_id, req.reason or "aborted by peer"))

    def stats(self, req: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        s = self.rx.stats()
        return pb.StatsReply(
            total_blocks=s["total_blocks"],
            free_blocks=s["free_blocks"],
            used_blocks=s["used_blocks"],
            in_flight=s["in_flight"],
            node_id=node_id(),
            shm_ok=bool(req.shm_probe) and self.segments.probe(req.shm_probe),
        )

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Handshake": grpc.unary_unary_rpc_method_handler(
                    self.handshake, pb.HandshakeRequest.FromString, pb.HandshakeReply.SerializeToString
                ),
                "Transfer": grpc.stream_unary_rpc_method_handler(
                    self.transfer, decode_chunk, pb.TransferAck.SerializeToString
                ),
                "SharedMemoryTransfer": grpc.stream_stream_rpc_method_handler(
                    self.shm_transfer, decode_chunk, pb.SlotRelease.SerializeToString
                ),
                "Abort": grpc.unary_unary_rpc_method_handler(
                    self.abort, pb.AbortRequest.FromString, pb.AbortReply.SerializeToString
                ),
                "Stats": grpc.unary_unary_rpc_method_handler(
                    self.stats, pb.StatsRequest.FromString, pb.StatsReply.SerializeToString
                ),
            },
        )


# ---------------------------------------------------------------------------------------------
# client


class _RequestStream:
    """A bounded queue feeding one client-streaming call: the sender blocks (never buffers without
    bound) while gRPC is behind, and learns at once when the receiver has ended the call."""

    def __init__(self, maxsize: int) -> None:
        self.q: queue.Queue[bytes | None] = queue.Queue(maxsize)
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[bytes]:
        while not self.closed.is_set():
            try:
                item = self.q.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            yield item

    def put(self, item: bytes | None, done: Callable[[], bool]) -> bool:
        while not done() and not self.closed.is_set():
            try:
                self.q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        self.closed.set()


class _GrpcSession(SenderSession):
    path = "grpc"

    def __init__(self, transport: GrpcKVTransport, peer: str, request_id: str) -> None:
        cfg = transport.config
        self.request_id = request_id
        self.timeout = cfg.rpc_timeout_s
        md = transport.metadata(request_id)
        self.streams: list[_RequestStream] = []
        self.calls: list[grpc.Future] = []
        for i in range(cfg.num_streams):
            stream = _RequestStream(cfg.max_inflight_chunks)
            call = transport.channel(peer, i).stream_unary(
                f"/{SERVICE}/Transfer",
                request_serializer=_identity,
                response_deserializer=pb.TransferAck.FromString,
            )
            self.streams.append(stream)
            self.calls.append(call.future(iter(stream), timeout=self.timeout, metadata=md))

    def _verdict(self, call: grpc.Future) -> pb.TransferAck:
        try:
            return call.result(timeout=self.timeout)
        except grpc.RpcError as e:
            raise _rpc_error(e, self.request_id) from None
        except grpc.FutureTimeoutError:
            raise KVTransferError(TransferStatus.TIMEOUT, "no acknowledgement", self.request_id) from None

    def send_chunk(self, plan: ChunkPlan, info_views: tuple) -> None:
        info, views = info_views
        msg = encode_chunk(header_pb(info), views)
        i = plan.seq % len(self.streams)
        if not self.streams[i].put(msg, self.calls[i].done):
            ack = self._verdict(self.calls[i])
            status = _ACK_TO_STATUS[ack.status]
            raise KVTransferError(
                TransferStatus.ABORTED if status is TransferStatus.OK else status, ack.detail, self.request_id
            )

    def finish(self) -> tuple[TransferStatus, str]:
        for stream, call in zip(self.streams, self.calls, strict=True):
            stream.put(None, call.done)
        final: tuple[TransferStatus, str] | None = None
        for call in self.calls:
            try:
                ack = self._verdict(call)
            except KVTransferError as e:
                return e.status, e.detail
            status = _ACK_TO_STATUS[ack.status]
            if status is not TransferStatus.OK:
                return status, ack.detail
            if ack.final:
                final = (status, ack.detail)
        return final or (TransferStatus.TRUNCATED, "no stream carried the final acknowledgement")

    def cancel(self) -> None:
        for stream, call in zip(self.streams, self.calls, strict=True):
            stream.close()
            call.cancel()


class _ShmSession(SenderSession):
    path = "shm"

    def __init__(self, transport: GrpcKVTransport, peer: str, request_id: str, ring: ShmRing) -> None:
        cfg = transport.config
        self.request_id = request_id
        self.ring = ring
        cache = transport.cache
        self.cache_shm = transport.zero_copy_segment()
        self.cache_base = cache.data.data_ptr()
        self.cache_nbytes = cache.nbytes
        self.timeout = cfg.rpc_timeout_s
        # Zero-copy chunks hold no slot, so the stream is bounded by the in-flight limit instead.
        self.stream = _RequestStream(max(ring.num_slots, cfg.max_inflight_chunks) + 1)
        self.outstanding: set[int] = set()
        self.lock = threading.Lock()
        self.ack: pb.TransferAck | None = None
        self.error: KVTransferError | None = None
        self.done = threading.Event()
        call = transport.channel(peer, 0).stream_stream(
            f"/{SERVICE}/SharedMemoryTransfer",
            request_serializer=_identity,
            response_deserializer=pb.SlotRelease.FromString,
        )
        self.responses = call(
            iter(self.stream), timeout=self.timeout, metadata=transport.metadata(request_id)
        )
        threading.Thread(target=self._read, name=f"kv-shm-{request_id}", daemon=True).start()

    def _read(self) -> None:
        try:
            for r in self.responses:
                if r.HasField("ack"):
                    self.ack = r.ack
                    break
                if r.shm_name == self.ring.name:
                    self._release(r.shm_offset)
        except grpc.RpcError as e:
            self.error = _rpc_error(e, self.request_id)
        finally:
            # The receiver has stopped reading this stream: every slot it still had is ours again.
            with self.lock:
                left, self.outstanding = self.outstanding, set()
            for off in left:
                self.ring.release(off)
            self.done.set()

    def _release(self, off: int) -> None:
        with self.lock:
            if off not in self.outstanding:
                return
            self.outstanding.discard(off)
        self.ring.release(off)

    def _raise_ended(self) -> None:
        if self.error is not None:
            raise self.error
        status = _ACK_TO_STATUS[self.ack.status] if self.ack is not None else TransferStatus.ABORTED
        detail = self.ack.detail if self.ack is not None else "stream ended"
        raise KVTransferError(
            TransferStatus.ABORTED if status is TransferStatus.OK else status, detail, self.request_id
        )

    def _in_cache(self, views: list[memoryview]) -> int | None:
        """Byte offset of the payload in the shared-memory KV cache, when it is one range of it."""
        if self.cache_shm is None or len(views) != 1:
            return None
        v = views[0]
        off = np.frombuffer(v, dtype=np.uint8).ctypes.data - self.cache_base
        return off if off >= 0 and off + v.nbytes <= self.cache_nbytes else None

    def send_chunk(self, plan: ChunkPlan, info_views: tuple) -> None:
        info, views = info_views
        if self.done.is_set():
            self._raise_ended()
        off = self._in_cache(views)
        if off is not None:
            # Zero-copy: the receiver reads the leased blocks where they are; the lease keeps them
            # unchanged until the acknowledgement, and the checksum proves it.
            header = header_pb(info, shm_name=self.cache_shm, shm_offset=off)
        else:
            off = self.ring.acquire(self.timeout)
            with self.lock:
                self.outstanding.add(off)
            self.ring.write(off, views)
            header = header_pb(info, shm_name=self.ring.name, shm_offset=off, release_slot=True)
        if not self.stream.put(encode_chunk(header), self.done.is_set):
            self._raise_ended()

    def finish(self) -> tuple[TransferStatus, str]:
        self.stream.put(None, self.done.is_set)
        if not self.done.wait(self.timeout):
            self.cancel()
            return TransferStatus.TIMEOUT, "no acknowledgement"
        if self.error is not None:
            return self.error.status, self.error.detail
        if self.ack is None:
            return TransferStatus.ABORTED, "stream ended without acknowledgement"
        return _ACK_TO_STATUS[self.ack.status], self.ack.detail

    def cancel(self) -> None:
        self.stream.close()
        self.responses.cancel()


@register_transport("grpc")
class GrpcKVTransport(KVTransport):
    """gRPC backend. ``host``/``port`` say where :meth:`serve` listens (port 0: any free port).
    With ``config.same_node_fast_path`` a peer on the same node is reached through shared memory."""

    force_shm = False

    def __init__(self, *args, host: str = "127.0.0.1", port: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.host = host
        self.port = port
        self._server: grpc.Server | None = None
        self._service: _KVService | None = None
        self._channels: dict[tuple[str, int], grpc.Channel] = {}
        self._routes: dict[str, str] = {}
        self._ring: ShmRing | None = None

    # -- security ---------------------------------------------------------------------------------
    def metadata(self, request_id: str = "") -> list[tuple[str, str]]:
        md = [(_RID_KEY, request_id)] if request_id else []
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
        interceptors = [_AuthInterceptor(cfg.auth_token)] if cfg.auth_token else []
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kv-rx"),
            options=self._options(),
            interceptors=interceptors,
        )
        self._service = _KVService(self)
        self._server.add_generic_rpc_handlers((self._service.handler(),))
        target = f"{self.host}:{self.port}"
        if cfg.tls_cert_file and cfg.tls_key_file:
            creds = grpc.ssl_server_credentials(
                [(Path(cfg.tls_key_file).read_bytes(), Path(cfg.tls_cert_file).read_bytes())]
            )
            port = self._server.add_secure_port(target, creds)
        else:
            port = self._server.add_insecure_port(target)
        self._server.start()
        return f"{self.host}:{port}"

    # -- client -----------------------------------------------------------------------------------
    def channel(self, peer: str, index: int = 0) -> grpc.Channel:
        with self.lock:
            ch = self._channels.get((peer, index))
            if ch is None:
                if self.config.tls_ca_file:
                    creds = grpc.ssl_channel_credentials(Path(self.config.tls_ca_file).read_bytes())
                    ch = grpc.secure_channel(peer, creds, options=self._options())
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
            raise _rpc_error(e, request_id) from None

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

    def _chunk_bytes(self, peer: str) -> int:
        return self.config.shm_chunk_bytes if self.route(peer) == "shm" else self.config.chunk_bytes

    def _connect(self, peer: str, hs: Handshake) -> tuple[HandshakeResult, SenderSession | None]:
        route = self.route(peer)
        fp = hs.fingerprint
        req = pb.HandshakeRequest(
            request_id=hs.request_id,
            fingerprint=pb.ModelFingerprint(
                architecture=fp["architecture"],
                dtype=fp["dtype"],
                num_layers=fp["num_layers"],
                num_kv_heads=fp["num_kv_heads"],
                head_dim=fp["head_dim"],
            ),
            sender_block_size=hs.sender_block_size,
            num_tokens=hs.num_tokens,
            first_token=hs.first_token,
            num_chunks=hs.num_chunks,
            attempt=hs.attempt,
            # The shared-memory path is one stream: it is bounded by memcpy, not by a socket.
            num_streams=1 if route == "shm" else hs.num_streams,
        )
        reply = self._unary(peer, "Handshake", req, pb.HandshakeReply, hs.request_id)
        result = HandshakeResult(
            _HS_TO_STATUS.get(reply.status, TransferStatus.INVALID),
            reply.receiver_block_size,
            reply.num_blocks,
            reply.free_blocks,
            reply.detail,
        )
        if result.status is not TransferStatus.OK:
            return result, None
        if route == "shm":
            return result, _ShmSession(self, peer, hs.request_id, self.ring())
        return result, _GrpcSession(self, peer, hs.request_id)

    def _abort_remote(self, peer: str, request_id: str, reason: str) -> None:
        self._unary(
            peer, "Abort", pb.AbortRequest(request_id=request_id, reason=reason), pb.AbortReply, request_id
        )

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
