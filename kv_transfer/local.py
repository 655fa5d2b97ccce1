"""``local``: both sides in one process (tests, a co-located prefill+decode). Chunks are still
checksummed and go through the same receiver, so this backend keeps the full contract."""

from __future__ import annotations

import itertools
import threading
import weakref

from .base import KVTransport, SenderSession, register_transport
from .types import Handshake, HandshakeResult, KVTransferError, TransferStatus
from .wire import ChunkPlan

_ENDPOINTS: weakref.WeakValueDictionary[str, LocalKVTransport] = weakref.WeakValueDictionary()
_ids = itertools.count()
_ids_lock = threading.Lock()


class _LocalSession(SenderSession):
    def __init__(self, peer: LocalKVTransport, request_id: str) -> None:
        self.peer = peer
        self.request_id = request_id
        self.failed: KVTransferError | None = None

    def send_chunk(self, plan: ChunkPlan, info_views: tuple) -> None:
        info, views = info_views
        payload = views[0] if len(views) == 1 else b"".join(views)
        try:
            self.peer.receiver.write(info, payload)
        except KVTransferError as e:
            self.failed = e
            raise

    def finish(self, commit: bytes) -> tuple[TransferStatus, str]:
        if self.failed is not None:
            return self.failed.status, self.failed.detail
        try:
            self.peer.receiver.commit(self.request_id, commit)
            status, _final, detail = self.peer.receiver.end_stream(self.request_id)
        except KVTransferError as e:
            return e.status, e.detail
        return status, detail

    def cancel(self) -> None:
        self.peer.receiver.abort(self.request_id, "sender cancelled")


@register_transport("local")
class LocalKVTransport(KVTransport):
    def _serve(self) -> str:
        with _ids_lock:
            address = f"local://{next(_ids)}"
        _ENDPOINTS[address] = self
        return address

    def _peer(self, peer: str) -> LocalKVTransport:
        target = _ENDPOINTS.get(peer)
        if target is None:
            raise KVTransferError(TransferStatus.UNAVAILABLE, f"no local endpoint {peer!r}")
        return target

    def _connect(self, peer: str, hs: Handshake) -> tuple[HandshakeResult, SenderSession | None]:
        # One stream whatever the config says: there is nothing to parallelise in-process.
        target = self._peer(peer)
        result = target.receiver.handshake(Handshake(**{**hs.__dict__, "num_streams": 1}))
        if result.status is not TransferStatus.OK:
            return result, None
        return result, _LocalSession(target, hs.request_id)

    def _abort_remote(self, peer: str, request_id: str, reason: str) -> None:
        self._peer(peer).receiver.abort(request_id, reason)

    def _shutdown(self) -> None:
        if self.address is not None:
            _ENDPOINTS.pop(self.address, None)
