"""The receiving end of the ``grpc`` and ``shm`` backends: the gRPC KV service (handshake, chunk
streams, shared-memory chunk headers, abort) and its token check."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator

import grpc

from proto import kv_transfer_pb2 as pb

from .base import KVTransport
from .grpc_codes import SERVICE, STATUS_TO_HS, attempt_of, make_ack, request_id_of
from .shm import ShmAttachments, node_id
from .types import Handshake, KVTransferError, TransferStatus
from .wire import decode_chunk, info_from_pb

log = logging.getLogger(__name__)


class AuthInterceptor(grpc.ServerInterceptor):
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


class KVService:
    def __init__(self, transport: KVTransport) -> None:
        self.transport = transport
        self.rx = transport.receiver
        self.segments = ShmAttachments(transport.config.max_shm_segments)

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
            reserve_tokens=req.reserve_tokens,
        )
        r = self.rx.handshake(hs)
        return pb.HandshakeReply(
            status=STATUS_TO_HS.get(r.status, pb.HandshakeReply.INVALID),
            receiver_block_size=r.receiver_block_size,
            num_blocks=r.num_blocks,
            free_blocks=r.free_blocks,
            detail=r.detail,
        )

    def transfer(self, chunks: Iterator, context: grpc.ServicerContext) -> pb.TransferAck:
        rid, attempt = request_id_of(context), attempt_of(context)
        try:
            for header, payload in chunks:
                if header.request_id != rid:
                    raise KVTransferError(
                        TransferStatus.INVALID, "chunk of another request on this stream", rid
                    )
                if header.HasField("commit"):
                    self.rx.commit(rid, header.commit, attempt)
                    continue
                self.rx.write(info_from_pb(header), payload, attempt)
            status, final, detail = self.rx.end_stream(rid, attempt)
            return make_ack(status, rid, detail, final)
        except KVTransferError as e:
            return make_ack(e.status, rid, e.detail)
        except Exception as e:  # the stream broke (sender cancelled or died): free what arrived
            self.rx.fail(rid, TransferStatus.ABORTED, f"stream broken: {e!r}", attempt)
            return make_ack(TransferStatus.ABORTED, rid, "stream broken")

    def shm_transfer(self, chunks: Iterator, context: grpc.ServicerContext) -> Iterator[pb.SlotRelease]:
        rid, attempt = request_id_of(context), attempt_of(context)
        try:
            for header, _ in chunks:
                if header.HasField("commit"):
                    if header.request_id != rid:
                        raise KVTransferError(
                            TransferStatus.INVALID, "commit of another request on this stream", rid
                        )
                    self.rx.commit(rid, header.commit, attempt)
                    continue
                buf = self._segment(header.shm_name, rid)
                payload = buf[header.shm_offset : header.shm_offset + header.nbytes]
                if header.request_id != rid or len(payload) != header.nbytes:
                    raise KVTransferError(TransferStatus.INVALID, "bad shared-memory chunk header", rid)
                self.rx.write(info_from_pb(header), payload, attempt)
                if header.release_slot:  # an in-place read needs no answer: one message less per chunk
                    yield pb.SlotRelease(shm_offset=header.shm_offset, shm_name=header.shm_name)
            status, final, detail = self.rx.end_stream(rid, attempt)
            yield pb.SlotRelease(ack=make_ack(status, rid, detail, final))
        except KVTransferError as e:
            # Its blocks come back at once (a no-op when already freed, or when a retry has replaced this attempt).
            self.rx.fail(rid, e.status, e.detail, attempt)
            yield pb.SlotRelease(ack=make_ack(e.status, rid, e.detail))
        except Exception as e:
            self.rx.fail(rid, TransferStatus.ABORTED, f"stream broken: {e!r}", attempt)

    def _segment(self, name: str, rid: str) -> memoryview:
        """The sender's segment named in a chunk header; a name not of our pattern is never opened."""
        try:
            return self.segments.get(name).buf
        except KVTransferError as e:
            raise KVTransferError(e.status, e.detail, rid) from None
        except OSError as e:
            raise KVTransferError(
                TransferStatus.INVALID, f"cannot open shared-memory segment {name!r}: {e.strerror or e}", rid
            ) from None

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
