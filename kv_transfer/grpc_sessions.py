"""The sending end of the ``grpc`` and ``shm`` backends: one session per transfer, over parallel
gRPC client streams (payloads in the messages) or over the shared-memory ring (headers only)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc
import numpy as np

from proto import kv_transfer_pb2 as pb

from .base import SenderSession
from .config import TransferConfig
from .grpc_codes import ACK_TO_STATUS, POLL_S, SERVICE, identity, rpc_error
from .shm import ShmRing
from .types import KVTransferError, TransferStatus
from .wire import ChunkPlan, commit_message, encode_chunk, header_pb


class SessionHost(Protocol):
    """What a sender session needs of its transport (``GrpcKVTransport``)."""

    config: TransferConfig

    def channel(self, peer: str, index: int = 0) -> grpc.Channel: ...

    def metadata(self, request_id: str = "", attempt: int | None = None) -> list[tuple[str, str]]: ...

    def zero_copy_segment(self): ...


class RequestStream:
    """A bounded queue feeding one client-streaming call: the sender blocks (never buffers without
    bound) while gRPC is behind, and learns at once when the receiver has ended the call."""

    def __init__(self, maxsize: int) -> None:
        self.q: queue.Queue[bytes | None] = queue.Queue(maxsize)
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[bytes]:
        while not self.closed.is_set():
            try:
                item = self.q.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            yield item

    def put(self, item: bytes | None, done: Callable[[], bool]) -> bool:
        while not done() and not self.closed.is_set():
            try:
                self.q.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        self.closed.set()


class GrpcSession(SenderSession):
    path = "grpc"

    def __init__(self, transport: SessionHost, peer: str, request_id: str, attempt: int) -> None:
        cfg = transport.config
        self.request_id = request_id
        self.timeout = cfg.rpc_timeout_s
        md = transport.metadata(request_id, attempt)
        self.streams: list[RequestStream] = []
        self.calls: list[grpc.Future] = []
        for i in range(cfg.num_streams):
            stream = RequestStream(cfg.max_inflight_chunks)
            call = transport.channel(peer, i).stream_unary(
                f"/{SERVICE}/Transfer",
                request_serializer=identity,
                response_deserializer=pb.TransferAck.FromString,
            )
            self.streams.append(stream)
            self.calls.append(call.future(iter(stream), timeout=self.timeout, metadata=md))

    def _verdict(self, call: grpc.Future) -> pb.TransferAck:
        try:
            return call.result(timeout=self.timeout)
        except grpc.RpcError as e:
            raise rpc_error(e, self.request_id) from None
        except grpc.FutureTimeoutError:
            raise KVTransferError(TransferStatus.TIMEOUT, "no acknowledgement", self.request_id) from None

    def send_chunk(self, plan: ChunkPlan, info_views: tuple) -> None:
        info, views = info_views
        msg = encode_chunk(header_pb(info), views)
        i = plan.seq % len(self.streams)
        if not self.streams[i].put(msg, self.calls[i].done):
            ack = self._verdict(self.calls[i])
            status = ACK_TO_STATUS[ack.status]
            raise KVTransferError(
                TransferStatus.ABORTED if status is TransferStatus.OK else status, ack.detail, self.request_id
            )

    def finish(self, commit: bytes) -> tuple[TransferStatus, str]:
        # The commit goes last on the first stream: the receiver's final verdict waits for every stream to end,
        # so it is in before the KV is handed over, whichever stream ends last.
        self.streams[0].put(commit_message(self.request_id, commit), self.calls[0].done)
        for stream, call in zip(self.streams, self.calls, strict=True):
            stream.put(None, call.done)
        final: tuple[TransferStatus, str] | None = None
        for call in self.calls:
            try:
                ack = self._verdict(call)
            except KVTransferError as e:
                return e.status, e.detail
            status = ACK_TO_STATUS[ack.status]
            if status is not TransferStatus.OK:
                return status, ack.detail
            if ack.final:
                final = (status, ack.detail)
        return final or (TransferStatus.TRUNCATED, "no stream carried the final acknowledgement")

    def cancel(self) -> None:
        # Cancel before closing: a closed request stream alone ends the call cleanly, which the receiver would
        # read as this attempt's end rather than its abort.
        for stream, call in zip(self.streams, self.calls, strict=True):
            call.cancel()
            stream.close()


class ShmSession(SenderSession):
    path = "shm"

    def __init__(
        self, transport: SessionHost, peer: str, request_id: str, ring: ShmRing, attempt: int
    ) -> None:
        cfg = transport.config
        self.request_id = request_id
        self.ring = ring
        cache = transport.cache
        self.cache_shm = transport.zero_copy_segment()
        self.cache_base = cache.data.data_ptr()
        self.cache_nbytes = cache.nbytes
        self.timeout = cfg.rpc_timeout_s
        # Zero-copy chunks hold no slot, so the stream is bounded by the in-flight limit instead.
        self.stream = RequestStream(max(ring.num_slots, cfg.max_inflight_chunks) + 1)
        self.outstanding: set[int] = set()
        self.lock = threading.Lock()
        self.ack: pb.TransferAck | None = None
        self.error: KVTransferError | None = None
        self.done = threading.Event()
        call = transport.channel(peer, 0).stream_stream(
            f"/{SERVICE}/SharedMemoryTransfer",
            request_serializer=identity,
            response_deserializer=pb.SlotRelease.FromString,
        )
        self.responses = call(
            iter(self.stream), timeout=self.timeout, metadata=transport.metadata(request_id, attempt)
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
            self.error = rpc_error(e, self.request_id)
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
        status = ACK_TO_STATUS[self.ack.status] if self.ack is not None else TransferStatus.ABORTED
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

    def finish(self, commit: bytes) -> tuple[TransferStatus, str]:
        self.stream.put(commit_message(self.request_id, commit), self.done.is_set)
        self.stream.put(None, self.done.is_set)
        if not self.done.wait(self.timeout):
            self.cancel()
            return TransferStatus.TIMEOUT, "no acknowledgement"
        if self.error is not None:
            return self.error.status, self.error.detail
        if self.ack is None:
            return TransferStatus.ABORTED, "stream ended without acknowledgement"
        return ACK_TO_STATUS[self.ack.status], self.ack.detail

    def cancel(self) -> None:
        self.responses.cancel()  # before the close, for the same reason as GrpcSession.cancel
        self.stream.close()
