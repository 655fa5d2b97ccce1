"""``torch_dist``: point-to-point torch.distributed between prefill and decode ranks, with the
backend the device names (``hccl`` on Gaudi, ``nccl`` on CUDA, ``gloo`` on CPU).

Two groups: the default one (long timeout) only carries the first header of a transfer, so an idle
receiver can wait for work indefinitely; everything inside a transfer goes on a second group whose
timeout is ``rpc_timeout_s`` (the deadline). A gloo pair that hits its deadline is closed by gloo, so
the transport is then marked broken and refuses further sends.

One transfer at a time per (sender, receiver) pair: the messages of a pair form one ordered stream.
A receiver-side abort reaches the sender with the final verdict (there is no back channel while
chunks flow); a sender-side abort reaches the receiver at the next chunk boundary.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

from .base import KVTransport, SenderSession, register_transport
from .types import ChunkInfo, Handshake, HandshakeResult, KVTransferError, TransferStatus
from .wire import ChunkPlan

log = logging.getLogger(__name__)

_HANDSHAKE, _CHUNK, _FINISH, _ABORT, _REPLY, _BYE = 1, 2, 3, 4, 5, 6
# header: int64 [kind, seq, layer, kv, first_block, num_blocks, crc32, nbytes]
_HDR_LEN = 8
_TAG_DATA, _TAG_REPLY = 11, 12


def device_backend(device: torch.device | str) -> str:
    return {"cuda": "nccl", "hpu": "hccl"}.get(torch.device(device).type, "gloo")


def _bytes_tensor(views: list[memoryview]) -> torch.Tensor:
    # [nbytes] uint8; one contiguous run needs no copy
    if len(views) == 1:
        return torch.frombuffer(views[0], dtype=torch.uint8)
    return torch.cat([torch.frombuffer(v, dtype=torch.uint8) for v in views])


class _DistSession(SenderSession):
    path = "torch_dist"

    def __init__(
        self, transport: TorchDistKVTransport, dst: int, request_id: str, pair_lock: threading.Lock
    ) -> None:
        self.t = transport
        self.dst = dst
        self.request_id = request_id
        self.pair_lock = pair_lock  # held from the handshake to finish/cancel
        self.wire = threading.RLock()
        self.ended = False

    def send_chunk(self, plan: ChunkPlan, info_views: tuple) -> None:
        info, views = info_views
        with self.wire:
            if self.ended:
                raise KVTransferError(TransferStatus.ABORTED, "cancelled", self.request_id)
            hdr = [
                _CHUNK,
                info.seq,
                info.layer,
                info.kv,
                info.first_block,
                info.num_blocks,
                info.crc32,
                info.nbytes,
            ]
            self.t._send_hdr(self.dst, hdr, self.t.data_group)
            self.t._send(_bytes_tensor(views), self.dst, _TAG_DATA)

    def finish(self, commit: bytes) -> tuple[TransferStatus, str]:
        with self.wire:
            if self.ended:
                return TransferStatus.ABORTED, "cancelled"
            try:
                # The commit's length in the header's last slot, its bytes on the data tag after it.
                self.t._send_hdr(self.dst, [_FINISH, 0, 0, 0, 0, 0, 0, len(commit)], self.t.data_group)
                if commit:
                    self.t._send(torch.frombuffer(bytearray(commit), dtype=torch.uint8), self.dst, _TAG_DATA)
                reply = self.t._recv_reply(self.dst)
            finally:
                self._end()
        return TransferStatus(reply["status"]), reply.get("detail", "")

    def cancel(self) -> None:
        with self.wire:
            if self.ended:
                return
            try:
                self.t._send_json(self.dst, _ABORT, {"request_id": self.request_id}, self.t.data_group)
            finally:
                self._end()

    def _end(self) -> None:
        self.ended = True
        self.t._sessions.pop(self.request_id, None)
        self.pair_lock.release()


@register_transport("torch_dist")
class TorchDistKVTransport(KVTransport):
    """``rank``/``world_size``/``init_method`` set up the default process group unless one exists;
    ``peers`` are the ranks this worker receives from (a decode worker lists its prefill ranks).
    Peers are addressed as ``"rank:<n>"``."""

    def __init__(
        self,
        *args,
        rank: int,
        world_size: int,
        init_method: str | None = None,
        backend: str | None = None,
        peers: tuple[int, ...] | list[int] = (),
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank
        self.backend = backend or device_backend(self.cache.device)
        if not dist.is_initialized():
            # Long timeout: this group only carries the first header, which an idle receiver awaits.
            dist.init_process_group(
                self.backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(days=7),
            )
        self.data_group = dist.new_group(
            list(range(world_size)),
            timeout=timedelta(seconds=self.config.rpc_timeout_s),
            backend=self.backend,
        )
        # gloo moves CPU tensors; nccl/hccl move device tensors.
        self.comm_device = torch.device("cpu") if self.backend == "gloo" else self.cache.device
        self.peers = list(peers)
        self._pair_locks: defaultdict[int, threading.Lock] = defaultdict(threading.Lock)
        self._sessions: dict[str, _DistSession] = {}
        self._threads: list[threading.Thread] = []
        self.broken: str | None = None

    # -- wire helpers -----------------------------------------------------------------------------
    def _send(self, t: torch.Tensor, dst: int, tag: int, group=None) -> None:
        try:
            dist.send(t.to(self.comm_device), dst, group=group or self.data_group, tag=tag)
        except RuntimeError as e:  # deadline or peer gone: gloo has closed the pair
            self.broken = str(e)
            raise KVTransferError(TransferStatus.TIMEOUT, f"send to rank {dst}: {e}") from None

    def _recv(self, t: torch.Tensor, src: int, tag: int, group=None) -> torch.Tensor:
        buf = t if t.device == self.comm_device else torch.empty_like(t, device=self.comm_device)
        try:
            dist.recv(buf, src, group=group or self.data_group, tag=tag)
        except RuntimeError as e:
            self.broken = str(e)
            raise KVTransferError(TransferStatus.TIMEOUT, f"recv from rank {src}: {e}") from None
        return buf if buf is t else buf.to(t.device)

    def _send_hdr(self, dst: int, fields: list[int], group, tag: int = _TAG_DATA) -> None:
        hdr = torch.zeros(_HDR_LEN, dtype=torch.int64)  # [8]
        hdr[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
        self._send(hdr, dst, tag, group)

    def _send_json(self, dst: int, kind: int, obj: dict, group, tag: int = _TAG_DATA) -> None:
        data = json.dumps(obj).encode()
        self._send_hdr(dst, [kind, 0, 0, 0, 0, 0, 0, len(data)], group, tag)
        self._send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, tag)

    def _recv_hdr(self, src: int, group, tag: int = _TAG_DATA) -> list[int]:
        return self._recv(torch.zeros(_HDR_LEN, dtype=torch.int64), src, tag, group).tolist()

    def _recv_json(self, src: int, nbytes: int, tag: int = _TAG_DATA) -> dict:
        buf = self._recv(torch.empty(nbytes, dtype=torch.uint8), src, tag)
        return json.loads(bytes(buf.numpy()).decode())

    def _recv_reply(self, src: int) -> dict:
        hdr = self._recv_hdr(src, self.data_group, _TAG_REPLY)
        return self._recv_json(src, hdr[7], _TAG_REPLY)

    def _reply(self, dst: int, obj: dict) -> None:
        self._send_json(dst, _REPLY, obj, self.data_group, _TAG_REPLY)

    # -- receiving --------------------------------------------------------------------------------
    def _serve(self) -> str:
        for src in self.peers:
            th = threading.Thread(target=self._rx_loop, args=(src,), name=f"kv-dist-rx-{src}", daemon=True)
            th.start()
            self._threads.append(th)
        return f"rank:{self.rank}"

    def _rx_loop(self, src: int) -> None:
        try:
            while not self._closed.is_set():
                hdr = self._recv_hdr(src, None)  # default group: waits while idle
                kind = hdr[0]
                if kind == _BYE:
                    return
                msg = self._recv_json(src, hdr[7]) if hdr[7] else {}
                if kind == _ABORT:
                    self.receiver.abort(msg.get("request_id", ""), "aborted by sender")
                elif kind == _HANDSHAKE:
                    hs = Handshake(**msg)
                    r = self.receiver.handshake(hs)
                    self._reply(
                        src,
                        {"status": r.status.value, "detail": r.detail, "block_size": r.receiver_block_size},
                    )
                    if r.status is TransferStatus.OK:
                        self._rx_transfer(src, hs)
        except KVTransferError as e:
            log.error("kv torch_dist receive loop from rank %d stopped: %s", src, e)

    def _rx_transfer(self, src: int, hs: Handshake) -> None:
        failed: KVTransferError | None = None
        try:
            while True:
                hdr = self._recv_hdr(src, self.data_group)
                kind = hdr[0]
                if kind == _CHUNK:
                    _, seq, layer, kv, first, n, crc, nbytes = hdr
                    buf = self._recv(torch.empty(nbytes, dtype=torch.uint8), src, _TAG_DATA)  # [nbytes]
                    if failed is None:
                        try:
                            info = ChunkInfo(hs.request_id, seq, layer, kv, first, n, crc, nbytes)
                            self.receiver.write(info, memoryview(buf.numpy()))
                        except KVTransferError as e:
                            failed = e  # keep draining: the sender streams until FINISH
                elif kind == _FINISH:
                    commit = b""
                    if hdr[7]:
                        commit = (
                            self._recv(torch.empty(hdr[7], dtype=torch.uint8), src, _TAG_DATA)
                            .numpy()
                            .tobytes()
                        )
                    if failed is None:
                        try:
                            self.receiver.commit(hs.request_id, commit)
                            status, _final, detail = self.receiver.end_stream(hs.request_id)
                        except KVTransferError as e:
                            status, detail = e.status, e.detail
                    else:
                        status, detail = failed.status, failed.detail
                    self._reply(src, {"status": status.value, "detail": detail})
                    return
                elif kind == _ABORT:
                    self._recv_json(src, hdr[7])
                    self.receiver.abort(hs.request_id, "aborted by sender")
                    return
        except KVTransferError as e:
            self.receiver.fail(hs.request_id, TransferStatus.TIMEOUT, str(e))
            raise

    # -- sending ----------------------------------------------------------------------------------
    @staticmethod
    def _rank(peer: str) -> int:
        if not peer.startswith("rank:"):
            raise ValueError(f"torch_dist peer must look like 'rank:<n>', got {peer!r}")
        return int(peer.split(":", 1)[1])

    def _connect(self, peer: str, hs: Handshake) -> tuple[HandshakeResult, SenderSession | None]:
        if self.broken:
            raise KVTransferError(
                TransferStatus.UNAVAILABLE, f"process group broken: {self.broken}", hs.request_id
            )
        dst = self._rank(peer)
        lock = self._pair_locks[dst]
        if not lock.acquire(timeout=self.config.rpc_timeout_s):
            raise KVTransferError(
                TransferStatus.TIMEOUT, f"rank {dst} busy with another transfer", hs.request_id
            )
        try:
            msg = {**hs.__dict__, "num_streams": 1}
            data = json.dumps(msg).encode()
            self._send_hdr(dst, [_HANDSHAKE, 0, 0, 0, 0, 0, 0, len(data)], None)
            self._send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, _TAG_DATA)
            reply = self._recv_reply(dst)
        except BaseException:
            lock.release()
            raise
        result = HandshakeResult(
            TransferStatus(reply["status"]), reply.get("block_size", 0), detail=reply.get("detail", "")
        )
        if result.status is not TransferStatus.OK:
            lock.release()
            return result, None
        session = _DistSession(self, dst, hs.request_id, lock)
        self._sessions[hs.request_id] = session
        return result, session

    def _abort_remote(self, peer: str, request_id: str, reason: str) -> None:
        if request_id in self._sessions:
            return  # the session sends ABORT in order when it is cancelled
        dst = self._rank(peer)
        with self._pair_locks[dst]:
            self._send_json(dst, _ABORT, {"request_id": request_id}, None)

    def say_goodbye(self, peer: str) -> None:
        """Tell a receiving peer that this sender is done (its receive loop for us ends)."""
        dst = self._rank(peer)
        try:
            with self._pair_locks[dst]:
                self._send_hdr(dst, [_BYE], None)
        except KVTransferError as e:
            # The peer closed the pair first (it stopped, or gloo's deadline passed): nobody is left to tell.
            log.info("goodbye to rank %d not sent: %s", dst, e)

    def _shutdown(self) -> None:
        for th in self._threads:
            th.join(timeout=1)
