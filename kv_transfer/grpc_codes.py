"""What both ends of the gRPC KV service agree on: the service name, metadata keys, and the mapping
between protobuf status codes and :class:`TransferStatus`."""

from __future__ import annotations

import grpc

from proto import kv_transfer_pb2 as pb

from .types import KVTransferError, TransferStatus

SERVICE = "bucketserve.kv.KVTransfer"
RID_KEY = "kv-request-id"
# A stream's attempt: a broken stream of an earlier attempt, whose end reaches the receiver after the retry's
# handshake, must not end the retry.
ATTEMPT_KEY = "kv-attempt"
POLL_S = 0.05

ACK_TO_STATUS = {
    pb.TransferAck.OK: TransferStatus.OK,
    pb.TransferAck.CHECKSUM: TransferStatus.CHECKSUM,
    pb.TransferAck.TRUNCATED: TransferStatus.TRUNCATED,
    pb.TransferAck.ABORTED: TransferStatus.ABORTED,
    pb.TransferAck.UNKNOWN: TransferStatus.UNKNOWN,
    pb.TransferAck.INVALID: TransferStatus.INVALID,
}
STATUS_TO_ACK = {v: k for k, v in ACK_TO_STATUS.items()}
HS_TO_STATUS = {
    pb.HandshakeReply.ACCEPTED: TransferStatus.OK,
    pb.HandshakeReply.FULL: TransferStatus.FULL,
    pb.HandshakeReply.MISMATCH: TransferStatus.MISMATCH,
    pb.HandshakeReply.INVALID: TransferStatus.INVALID,
    pb.HandshakeReply.DUPLICATE: TransferStatus.DUPLICATE,
    pb.HandshakeReply.ABORTED: TransferStatus.ABORTED,
}
STATUS_TO_HS = {v: k for k, v in HS_TO_STATUS.items()}
RPC_TO_STATUS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: TransferStatus.TIMEOUT,
    grpc.StatusCode.UNAUTHENTICATED: TransferStatus.UNAUTHENTICATED,
    grpc.StatusCode.CANCELLED: TransferStatus.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: TransferStatus.INVALID,
}


def rpc_error(e: grpc.RpcError, request_id: str) -> KVTransferError:
    code = e.code() if hasattr(e, "code") else None
    detail = e.details() if hasattr(e, "details") else str(e)
    return KVTransferError(
        RPC_TO_STATUS.get(code, TransferStatus.UNAVAILABLE), f"{code}: {detail}", request_id
    )


def make_ack(status: TransferStatus, request_id: str, detail: str = "", final: bool = True) -> pb.TransferAck:
    code = STATUS_TO_ACK.get(status, pb.TransferAck.ABORTED)
    if status not in STATUS_TO_ACK:
        detail = f"{status.value}: {detail}"
    return pb.TransferAck(status=code, request_id=request_id, detail=detail, final=final)


def identity(b: bytes) -> bytes:
    return b


def request_id_of(context: grpc.ServicerContext) -> str:
    return dict(context.invocation_metadata()).get(RID_KEY, "")


def attempt_of(context: grpc.ServicerContext) -> int | None:
    """The transfer attempt a stream belongs to (None from a sender that does not say)."""
    value = dict(context.invocation_metadata()).get(ATTEMPT_KEY)
    return int(value) if value is not None and value.isdigit() else None
