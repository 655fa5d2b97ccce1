"""Receiving side of every backend: handshake checks, block allocation, verified writes into the
paged cache (re-blocking when the sender's block size differs), completion, abort and expiry.

Backends only move bytes; this class owns every decision about the receiver's blocks, so the
no-leak invariant (``free + used == total``) is kept in one place.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.block_allocator import BlockAllocator, NoFreeBlocksError
from engine.kv_cache import KVCache

from .config import TransferConfig
from .types import ChunkInfo, Handshake, HandshakeResult, KVTransferError, ReceivedKV, TransferStatus
from .wire import _runs, crc32, payload_tensor

log = logging.getLogger(__name__)


# Copy-then-checksum granularity: small enough that the checksum reads the slice from the CPU's cache.
_CRC_SLICE = 256 << 10
# Put in the ready queue by wake(): never a request id (those are non-empty and printable).
_WAKE = "\x00wake"


def _byte_view(t: torch.Tensor) -> memoryview:
    # t: a contiguous CPU tensor; a writable view of its bytes (uint8 works for every dtype).
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass
class _Inbound:
    hs: Handshake
    block_ids: list[int]
    # dst flat slot of every token, only when the two block sizes differ: [num_tokens]
    slot_map: torch.Tensor | None
    started: float
    last_activity: float
    received: set[int] = field(default_factory=set)
    bytes: int = 0
    streams_done: int = 0
    closed: bool = False
    writers: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)
    commit: bytes = b""  # the sender's commit, once it came (the transfer's last message)


class KVReceiver:
    """Receive-side state of one worker. Thread-safe: transport threads call it concurrently."""

    def __init__(
        self,
        cache: KVCache,
        allocator: BlockAllocator,
        config: TransferConfig,
        lock: threading.RLock | None = None,
    ) -> None:
        self.cache = cache
        self.allocator = allocator
        self.config = config
        # Shared with the worker that owns the allocator, so allocations never race.
        self.lock = lock or threading.RLock()
        self._inbound: dict[str, _Inbound] = {}
        self._done: dict[str, tuple[_Inbound, float]] = {}
        self._ready: queue.Queue[str] = queue.Queue()
        # Why recent transfers were closed early, so every parallel stream of one reports the same status
        # (a checksum failure on one stream must read as retryable on the others too); bounded.
        self._ended: OrderedDict[str, tuple[TransferStatus, str]] = OrderedDict()
        # Requests aborted for good here (the client left, the request was given up), by when: a handshake for one
        # that arrives later (sent before its sender heard) is refused, or it would hold blocks nobody takes until
        # the receive timeout. Kept for that timeout; bounded.
        self._refused: OrderedDict[str, float] = OrderedDict()
        # The receiving worker's judgement of a handshake, called under ``lock`` with the handshake and the blocks
        # its KV takes, before they are allocated: False answers FULL. None: any request whose KV fits is taken.
        self.admission: Callable[[Handshake, int], bool] | None = None

    # -- handshake -------------------------------------------------------------------------------
    def handshake(self, hs: Handshake) -> HandshakeResult:
        spec = self.cache.spec
        try:
            hs.validate()
        except ValueError as e:
            return HandshakeResult(TransferStatus.INVALID, spec.block_size, detail=str(e))
        mine = spec.fingerprint()
        if dict(hs.fingerprint) != mine:
            diff = sorted(k for k in set(mine) | set(hs.fingerprint) if mine.get(k) != hs.fingerprint.get(k))
            return HandshakeResult(
                TransferStatus.MISMATCH, spec.block_size, detail=f"model fingerprint differs in {diff}"
            )
        need = spec.blocks_for_tokens(hs.num_tokens)
        with self.lock:
            if hs.request_id in self._refused:
                return self._aborted_here(hs)
            old = self._inbound.get(hs.request_id)
            if old is not None and hs.attempt <= old.hs.attempt or hs.request_id in self._done:
                return HandshakeResult(TransferStatus.DUPLICATE, spec.block_size, detail="already in flight")
            self._ended.pop(hs.request_id, None)
        if old is not None:
            # A retry replaces the failed attempt: free what it had.
            self._close(hs.request_id, TransferStatus.ABORTED, "superseded by a retry")
        with self.lock:
            if hs.request_id in self._refused:  # aborted while the retry's old attempt was being closed
                return self._aborted_here(hs)
            free = self.allocator.num_free
            if self.admission is not None and not self.admission(hs, need):
                log.info("kv receive %s refused: no room to finish it (%d blocks free)", hs.request_id, free)
                return HandshakeResult(
                    TransferStatus.FULL,
                    spec.block_size,
                    need,
                    free,
                    f"no room for {max(hs.reserve_tokens, hs.num_tokens)} tokens ({free} blocks free)",
                )
            try:
                ids = self.allocator.allocate(need)
            except NoFreeBlocksError:
                log.info("kv receive %s refused: needs %d blocks, %d free", hs.request_id, need, free)
                return HandshakeResult(
                    TransferStatus.FULL, spec.block_size, need, free, f"needs {need} blocks, {free} free"
                )
            now = time.monotonic()
            self._inbound[hs.request_id] = _Inbound(hs, ids, self._slot_map(hs, ids), now, now)
            return HandshakeResult(TransferStatus.OK, spec.block_size, need, self.allocator.num_free)

    def _aborted_here(self, hs: Handshake) -> HandshakeResult:
        """The answer to a handshake for a request aborted for good here (see :meth:`abort`): nothing reserved."""
        return HandshakeResult(
            TransferStatus.ABORTED, self.cache.spec.block_size, detail="aborted on the receiver"
        )

    def _slot_map(self, hs: Handshake, ids: list[int]) -> torch.Tensor | None:
        bs = self.cache.spec.block_size
        if hs.sender_block_size == bs:
            return None
        t = torch.arange(hs.num_tokens, device=self.cache.device)  # [num_tokens]
        blocks = torch.as_tensor(ids, dtype=torch.long, device=self.cache.device)
        return blocks[t // bs] * bs + t % bs  # [num_tokens] flat slot ids

    # -- chunks ----------------------------------------------------------------------------------
    def _get(self, request_id: str, attempt: int | None = None) -> _Inbound:
        """The request's transfer in flight. With ``attempt``, only that attempt's: a stream of an attempt a retry
        has replaced must not write into, commit or end the retry (its end can reach us after the retry's
        handshake, and a cancelled stream may even end cleanly)."""
        with self.lock:
            inb = self._inbound.get(request_id)
            if inb is None:
                status, detail = self._ended.get(
                    request_id, (TransferStatus.UNKNOWN, "no transfer in flight")
                )
                raise KVTransferError(status, detail, request_id)
            if attempt is not None and inb.hs.attempt != attempt:
                raise KVTransferError(
                    TransferStatus.ABORTED,
                    f"attempt {attempt} superseded by attempt {inb.hs.attempt}",
                    request_id,
                )
            return inb

    def write(
        self, info: ChunkInfo, payload: memoryview | bytes | torch.Tensor, attempt: int | None = None
    ) -> None:
        """Verify one chunk and copy it into this request's blocks. Raises KVTransferError (and frees
        the request's blocks) when the chunk is bad; the sender may retry with a new handshake. With
        ``attempt``, a chunk of another attempt than the one in flight is refused and changes nothing."""
        inb = self._get(info.request_id, attempt)
        hs = inb.hs
        spec = self.cache.spec
        nblocks_src = -(-hs.num_tokens // hs.sender_block_size)
        bad = None
        if not (0 <= info.seq < hs.num_chunks and 0 <= info.layer < spec.num_layers and info.kv in (0, 1)):
            bad = f"chunk seq {info.seq} layer {info.layer} kv {info.kv} out of range"
        elif info.num_blocks <= 0 or info.first_block + info.num_blocks > nblocks_src:
            bad = f"chunk blocks {info.first_block}+{info.num_blocks} exceed {nblocks_src}"
        if bad:
            self._close(info.request_id, TransferStatus.INVALID, bad, attempt)
            raise KVTransferError(TransferStatus.INVALID, bad, info.request_id)
        raw: memoryview | None = None
        # Bytes copied straight into host blocks are checksummed as they land (a slice at a time, still
        # in the CPU's cache), which saves a pass over memory; other paths check before they copy.
        fused = self.config.verify_checksums and self._direct(inb, not isinstance(payload, torch.Tensor))
        if isinstance(payload, torch.Tensor):
            src = payload.view(info.num_blocks, hs.sender_block_size, spec.num_kv_heads, spec.head_dim)
        else:
            if self.config.verify_checksums and not fused and crc32(payload) != info.crc32:
                self._bad_checksum(info, attempt)
            try:
                src = payload_tensor(spec, payload, info.num_blocks, hs.sender_block_size)
            except ValueError as e:
                self._close(info.request_id, TransferStatus.TRUNCATED, str(e), attempt)
                raise KVTransferError(TransferStatus.TRUNCATED, str(e), info.request_id) from None
            raw = memoryview(payload).cast("B")
        with inb.cond:
            closed = inb.closed
            if not closed:
                inb.writers += 1
        if closed:  # the lock of the reason is taken outside the request's condition
            raise self._ended_error(info.request_id)
        crc: int | None = None
        try:
            crc = self._copy_in(inb, info, src, raw, checksum=fused)
        finally:
            with inb.cond:
                inb.writers -= 1
                if crc is None or crc == info.crc32:
                    inb.received.add(info.seq)
                    inb.bytes += info.nbytes
                inb.last_activity = time.monotonic()
                inb.cond.notify_all()
        if crc is not None and crc != info.crc32:
            self._bad_checksum(info, attempt)  # the blocks are freed, so what landed in them is never decoded

    def _ended_error(self, request_id: str) -> KVTransferError:
        """The error of a transfer closed while this stream was writing: its real reason (a checksum failure on
        another stream stays retryable), ABORTED when none is known."""
        with self.lock:
            status, detail = self._ended.get(request_id, (TransferStatus.ABORTED, "aborted"))
        return KVTransferError(status, detail, request_id)

    def _direct(self, inb: _Inbound, as_bytes: bool) -> bool:
        """Whether a chunk is copied byte for byte into host blocks (no re-blocking, no device copy)."""
        return as_bytes and inb.slot_map is None and self.cache.data.device.type == "cpu"

    def _bad_checksum(self, info: ChunkInfo, attempt: int | None = None) -> None:
        detail = f"chunk {info.seq} (layer {info.layer}) checksum mismatch"
        self._close(info.request_id, TransferStatus.CHECKSUM, detail, attempt)
        raise KVTransferError(TransferStatus.CHECKSUM, detail, info.request_id)

    def _copy_in(
        self,
        inb: _Inbound,
        info: ChunkInfo,
        src: torch.Tensor,
        raw: memoryview | None = None,
        checksum: bool = False,
    ) -> int | None:
        """Copy the chunk into the request's blocks; with ``checksum``, returns the CRC-32 of the bytes
        as written (the caller compares it with the sender's)."""
        # src: [n, sender_block_size, KVH, D]; raw: the same bytes, when they came as bytes
        layer_kv = self.cache.data[info.layer, info.kv]  # [num_blocks + 1, block_size, KVH, D]
        if self._direct(inb, raw is not None):
            # A plain memcpy per run of blocks: torch's copy_ splits large copies over its intra-op
            # threads, which on a small shared host measured ~20x slower than one thread.
            ids = inb.block_ids[info.first_block : info.first_block + info.num_blocks]
            per_block = raw.nbytes // info.num_blocks
            pos, crc = 0, 0
            for start, n in _runs(ids):
                dst = _byte_view(layer_kv[start : start + n])
                if not checksum:
                    dst[:] = raw[pos : pos + n * per_block]
                else:
                    for off in range(0, len(dst), _CRC_SLICE):
                        end = min(off + _CRC_SLICE, len(dst))
                        dst[off:end] = raw[pos + off : pos + end]
                        crc = crc32(dst[off:end], crc)
                pos += n * per_block
            return crc if checksum else None
        if checksum:
            raise ValueError("a fused checksum needs raw bytes and a host cache")
        src = src.to(self.cache.device)
        if inb.slot_map is None:
            ids = inb.block_ids[info.first_block : info.first_block + info.num_blocks]
            pos = 0
            for start, n in _runs(ids):
                layer_kv[start : start + n].copy_(src[pos : pos + n])
                pos += n
            return None
        # Re-block: token t of the request goes to slot slot_map[t] whatever the two block sizes.
        bs_src = inb.hs.sender_block_size
        tok0 = info.first_block * bs_src
        tok1 = min(tok0 + info.num_blocks * bs_src, inb.hs.num_tokens)
        tokens = src.reshape(-1, src.shape[-2], src.shape[-1])[: tok1 - tok0]  # [tokens, KVH, D]
        self.cache.flat_slots(info.layer, info.kv).index_copy_(0, inb.slot_map[tok0:tok1], tokens)
        return None

    def commit(self, request_id: str, payload: bytes, attempt: int | None = None) -> None:
        """The transfer's commit (its sender's last message): handed over with the KV once every stream ends."""
        inb = self._get(request_id, attempt)
        with inb.cond:
            inb.commit = bytes(payload)
            inb.last_activity = time.monotonic()

    def end_stream(self, request_id: str, attempt: int | None = None) -> tuple[TransferStatus, bool, str]:
        """One transfer stream ended. Returns (status, final, detail); final is False while other
        parallel streams of the request are still running. With ``attempt``, a stream of a replaced attempt
        is not counted (KVTransferError ABORTED)."""
        inb = self._get(request_id, attempt)
        with inb.cond:
            inb.streams_done += 1
            if inb.streams_done < inb.hs.num_streams:
                return TransferStatus.OK, False, ""
            inb.cond.wait_for(lambda: inb.writers == 0, timeout=self.config.rpc_timeout_s)
            missing = inb.hs.num_chunks - len(inb.received)
        if missing:
            detail = f"{missing} of {inb.hs.num_chunks} chunks missing"
            self._close(request_id, TransferStatus.TRUNCATED, detail, attempt)
            return TransferStatus.TRUNCATED, True, detail
        with self.lock:
            if self._inbound.pop(request_id, None) is None:
                return TransferStatus.ABORTED, True, "aborted"
            self._done[request_id] = (inb, time.monotonic())
        self._ready.put(request_id)
        return TransferStatus.OK, True, ""

    # -- handing over, abort, expiry ------------------------------------------------------------
    def wake(self) -> None:
        """End a :meth:`take` that waits now (it returns None): its thread has other work (a lent prompt batch, an
        abort), so it can wait long while idle without polling."""
        self._ready.put(_WAKE)

    def take(self, timeout: float | None = None) -> ReceivedKV | None:
        """Next completed transfer; the caller now owns its blocks (and frees them when done). None at the timeout,
        or when :meth:`wake` is called."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                rid = self._ready.get(timeout=left)
            except queue.Empty:
                return None
            if rid == _WAKE:
                return None
            with self.lock:
                item = self._done.pop(rid, None)
            if item is not None:  # else aborted or expired after it completed
                inb, _ = item
                return ReceivedKV(
                    rid,
                    inb.block_ids,
                    inb.hs.num_tokens,
                    inb.hs.first_token,
                    inb.bytes,
                    time.monotonic() - inb.started,
                    inb.commit,
                    inb.hs.reserve_tokens,
                )

    def _close(
        self, request_id: str, status: TransferStatus, reason: str, attempt: int | None = None
    ) -> bool:
        with self.lock:
            if attempt is not None:
                current = self._inbound.get(request_id) or self._done.get(request_id, (None, 0.0))[0]
                if current is not None and current.hs.attempt != attempt:
                    log.info(
                        "kv receive %s: attempt %d ended (%s), attempt %d goes on",
                        request_id,
                        attempt,
                        reason,
                        current.hs.attempt,
                    )
                    return False
            inb = self._inbound.pop(request_id, None)
            done = self._done.pop(request_id, None)
            if inb is None and done is not None:
                inb = done[0]
            if inb is None:
                return False
            self._ended[request_id] = (status, reason or status.value)
            while len(self._ended) > 4096:
                self._ended.popitem(last=False)
        with inb.cond:
            inb.closed = True
            # A copy into these blocks may be running on another thread: free only after it ends.
            inb.cond.wait_for(lambda: inb.writers == 0)
        with self.lock:
            self.allocator.free(inb.block_ids)
        log.info("kv receive %s closed (%s): %s", request_id, status.value, reason)
        return True

    def abort(self, request_id: str, reason: str = "", final: bool = False) -> bool:
        """Free whatever this request holds here (in flight or received but not taken). ``final``: the request is
        gone for good, so a handshake for it that comes later is refused (ABORTED) instead of reserving blocks."""
        if final:
            with self.lock:
                # Marked before the close, under the lock the handshake allocates under: a handshake either sees
                # the mark or has allocated already, and then the close below frees what it took.
                self._refused[request_id] = time.monotonic()
                self._refused.move_to_end(request_id)
                while len(self._refused) > 4096:
                    self._refused.popitem(last=False)
        return self._close(request_id, TransferStatus.ABORTED, reason)

    def fail(self, request_id: str, status: TransferStatus, reason: str, attempt: int | None = None) -> bool:
        """End a transfer that failed on the wire. With ``attempt``, only that attempt: a stream of an earlier
        attempt that breaks after a retry's handshake leaves the retry alone."""
        return self._close(request_id, status, reason, attempt)

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        ttl = self.config.receive_timeout_s
        with self.lock:
            stale = [r for r, inb in self._inbound.items() if now - inb.last_activity > ttl]
            stale += [r for r, (_, t) in self._done.items() if now - t > ttl]
            while self._refused and now - next(iter(self._refused.values())) > ttl:
                self._refused.popitem(last=False)
        for rid in stale:
            self._close(rid, TransferStatus.TIMEOUT, f"no progress for {ttl}s")
        return stale

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {
                "total_blocks": self.allocator.num_blocks,
                "free_blocks": self.allocator.num_free,
                "used_blocks": self.allocator.num_used,
                "in_flight": len(self._inbound),
                "received_not_taken": len(self._done),
            }

    def is_idle(self) -> bool:
        with self.lock:
            return not self._inbound and not self._done

    def arriving(self) -> dict[str, tuple[int, int]]:
        """Requests whose KV is here or on its way, not yet taken: request id -> (blocks held, tokens reserved)."""
        with self.lock:
            items = [*self._inbound.items(), *((rid, inb) for rid, (inb, _) in self._done.items())]
            return {rid: (len(inb.block_ids), inb.hs.reserve_tokens) for rid, inb in items}
