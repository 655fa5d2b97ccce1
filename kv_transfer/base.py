"""The ``KVTransport`` interface, its registry, and the sending logic every backend shares
(leases, layer-by-layer streaming, checksums, retries, aborts and metrics).

A backend implements three things: ``_serve`` (start receiving, return an address), ``_connect``
(handshake with a peer, returning a :class:`SenderSession` that moves chunks) and ``_abort_remote``.
All decisions about blocks live here and in :class:`KVReceiver`.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from engine.block_allocator import BlockAllocator
from engine.kv_cache import KVCache

from .config import TransferConfig
from .faults import FaultInjector
from .leases import LeaseTable
from .receiver import KVReceiver
from .types import Handshake, HandshakeResult, KVTransferError, ReceivedKV, TransferMetrics, TransferStatus
from .wire import ChunkPlan, chunk_info, chunk_views, plan_chunks

log = logging.getLogger(__name__)

_REGISTRY: dict[str, type[KVTransport]] = {}


def register_transport(name: str):
    """Class decorator: make a backend available to :func:`create_transport` under ``name``."""

    def deco(cls: type[KVTransport]) -> type[KVTransport]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"KV transport {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


# The built-in backends, imported on first use: importing kv_transfer must not pull in grpc and
# torch.distributed for a process that uses neither.
_BUILTIN = {
    "grpc": "kv_transfer.grpc_transport",
    "shm": "kv_transfer.grpc_transport",
    "local": "kv_transfer.local",
    "torch_dist": "kv_transfer.torch_dist",
}


def transport_names() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN))


def get_transport_class(name: str) -> type[KVTransport]:
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"kv transport: unknown backend {name!r}; expected one of {transport_names()}"
        ) from None


def create_transport(
    name: str,
    cache: KVCache,
    allocator: BlockAllocator,
    config: TransferConfig | None = None,
    **kwargs: object,
) -> KVTransport:
    return get_transport_class(name)(cache, allocator, config or TransferConfig(), **kwargs)


class SenderSession(ABC):
    """One accepted attempt of one transfer: moves chunks to the peer, then asks for its verdict."""

    # The way the bytes go (reported in metrics): a backend may pick among several per peer.
    path: ClassVar[str] = ""

    @abstractmethod
    def send_chunk(self, plan: ChunkPlan, info_views: tuple) -> None:
        """Send one chunk ((ChunkInfo, views)); raise KVTransferError when the peer has ended the
        transfer (abort, bad chunk)."""

    @abstractmethod
    def finish(self, commit: bytes) -> tuple[TransferStatus, str]:
        """All chunks handed over: send the commit as the transfer's last message (the receiver hands the KV
        over with it), then wait for the receiver's verdict."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop this attempt without a verdict (abort or error on the sender)."""


@dataclass
class _Outbound:
    peer: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    first_token: int
    plans: list[ChunkPlan]
    metrics: TransferMetrics
    t0: float
    reserve_tokens: int = 0
    attempt: int = 0  # attempts of this send so far (1 once the first handshake is made)
    session: SenderSession | None = None
    sent_layers: set[int] = field(default_factory=set)
    # A retryable verdict seen mid-stream: stop sending this attempt, retry at finish().
    broken: KVTransferError | None = None
    aborted: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class KVTransport(ABC):
    """Moves a request's KV blocks from a prefill worker's cache into a decode worker's cache.

    Sending side, one transaction per request::

        t.send(peer, request_id, block_ids, num_tokens, first_token, commit)   # all at once, or:
        t.begin_send(peer, ...); t.send_layer(request_id, i) as layers are written; t.finish(request_id, commit)

    The handshake (``begin_send``) carries what the receiver must admit (``reserve_tokens``: the room the request
    may grow to there); the commit, the transfer's last message, carries what the receiver runs the request on
    (the cluster sends the prefilled request, first token included, which a streamed transfer only has at the
    end). The receiver hands over nothing before the commit, so a transfer that never commits leaves nothing
    behind there.

    The transport takes ownership of ``block_ids``: they are freed when the receiver acknowledges,
    when the transfer fails for good (``KVTransferError``: recompute), on abort, or when the lease
    expires. Receiving side: ``address = t.serve()``; ``t.receive(timeout)`` returns
    :class:`ReceivedKV` whose blocks the decode worker then owns. ``t.abort(request_id)`` frees the
    request on this side and tells the peer, in flight or not.
    """

    name: ClassVar[str] = ""

    def __init__(
        self,
        cache: KVCache,
        allocator: BlockAllocator,
        config: TransferConfig | None = None,
        *,
        lock: threading.RLock | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        self.cache = cache
        self.allocator = allocator
        self.config = config or TransferConfig()
        self.lock = lock or threading.RLock()
        self.receiver = KVReceiver(cache, allocator, self.config, self.lock)
        self.leases = LeaseTable(allocator, self.config.lease_ttl_s, self.lock)
        self.faults = faults or FaultInjector()
        self._outbound: dict[str, _Outbound] = {}
        self._metrics: deque[TransferMetrics] = deque(maxlen=1024)
        self._totals = {"transfers_ok": 0, "transfers_failed": 0, "bytes_sent": 0, "retries": 0}
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None
        # The attempt number a handshake carries: unique and increasing over every send of this transport, not
        # counted from 1 per send. A new send of a request id an earlier send gave up (aborted, then retried on the
        # same peer) must not share a number with it: the earlier send's cancelled streams can reach the receiver
        # after the new handshake, and the receiver tells a stale stream from the live one by this number. Numbers of
        # two senders are unrelated: another sender's handshake for a request in flight on a receiver replaces that
        # transfer when its number is higher and is refused (DUPLICATE) when not; one request has one sender at a
        # time, so this only decides who goes on after a sender was given up.
        self._wire_attempts = itertools.count(1)
        self.address: str | None = None

    # -- backend hooks ----------------------------------------------------------------------------
    @abstractmethod
    def _serve(self) -> str: ...

    @abstractmethod
    def _connect(self, peer: str, hs: Handshake) -> tuple[HandshakeResult, SenderSession | None]: ...

    @abstractmethod
    def _abort_remote(self, peer: str, request_id: str, reason: str) -> None: ...

    def _shutdown(self) -> None:  # noqa: B027  (optional hook: most backends hold nothing)
        """Release backend resources (servers, channels)."""

    # -- receiving --------------------------------------------------------------------------------
    def serve(self) -> str:
        """Start receiving; returns the address senders pass as ``peer``."""
        if self.address is None:
            self.address = self._serve()
            self._start_reaper()
        return self.address

    def receive(self, timeout: float | None = None) -> ReceivedKV | None:
        return self.receiver.take(timeout)

    # -- sending ----------------------------------------------------------------------------------
    def prepare(self, peer: str) -> None:  # noqa: B027  (optional hook: most backends connect for free)
        """Open what reaching ``peer`` takes (a channel, its route) before the first transfer to it, so the first
        request does not pay for it. Best effort: a peer that cannot be reached now fails its transfers by name."""

    def send(
        self,
        peer: str,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        first_token: int,
        commit: bytes = b"",
        reserve_tokens: int = 0,
    ) -> TransferMetrics:
        self.begin_send(peer, request_id, block_ids, num_tokens, first_token, reserve_tokens)
        return self.finish(request_id, commit)

    def begin_send(
        self,
        peer: str,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        first_token: int,
        reserve_tokens: int = 0,
    ) -> None:
        """Lease the blocks and handshake; raises KVTransferError (FULL, MISMATCH, ...) with the
        blocks freed. Layers then go with :meth:`send_layer`, the rest with :meth:`finish`."""
        spec = self.cache.spec
        need = spec.blocks_for_tokens(num_tokens) if num_tokens > 0 else 0
        if num_tokens <= 0 or len(block_ids) != need:
            raise ValueError(
                f"send {request_id!r}: {len(block_ids)} blocks for {num_tokens} tokens, expected {need}"
            )
        self._start_reaper()
        self.leases.grant(request_id, list(block_ids))
        out = _Outbound(
            peer,
            request_id,
            list(block_ids),
            num_tokens,
            first_token,
            [],  # planned per attempt, once the way to the peer is known
            TransferMetrics(request_id, self.name, peer, num_tokens),
            time.perf_counter(),
            reserve_tokens,
        )
        with self.lock:
            self._outbound[request_id] = out
        try:
            self._open_attempt(out)
        except BaseException as e:
            self._end(out, e if isinstance(e, KVTransferError) else None)
            raise

    def _chunk_bytes(self, peer: str) -> int:
        """Chunk size towards ``peer`` (a backend with several ways to a peer may pick per way)."""
        return self.config.chunk_bytes

    def _open_attempt(self, out: _Outbound) -> None:
        if not out.plans:
            out.plans = plan_chunks(self.cache.spec, len(out.block_ids), self._chunk_bytes(out.peer))
        out.attempt += 1
        out.metrics.attempts = out.attempt
        out.broken = None
        out.sent_layers = set()
        hs = Handshake(
            request_id=out.request_id,
            fingerprint=self.cache.spec.fingerprint(),
            sender_block_size=self.cache.spec.block_size,
            num_tokens=out.num_tokens,
            first_token=out.first_token,
            num_chunks=len(out.plans),
            attempt=self._next_wire_attempt(),
            num_streams=self.config.num_streams,
            reserve_tokens=out.reserve_tokens,
        )
        result, session = self._busy(out, lambda: self._connect(out.peer, hs))
        if result.status is not TransferStatus.OK or session is None:
            raise KVTransferError(result.status, result.detail, out.request_id)
        out.session = session
        out.metrics.backend = session.path or self.name

    def _next_wire_attempt(self) -> int:
        # The wire field is a uint32; wrapping after 4e9 handshakes only weakens the stale-stream check.
        return (next(self._wire_attempts) - 1) % 0xFFFFFFFF + 1

    def _busy(self, out: _Outbound, fn):
        lease = self.leases.get(out.request_id)
        if lease is None:
            raise KVTransferError(TransferStatus.ABORTED, out.aborted or "lease expired", out.request_id)
        lease.busy += 1
        try:
            return fn()
        finally:
            lease.busy -= 1

    def send_layer(self, request_id: str, layer: int) -> None:
        """Send every chunk of ``layer`` now (call when the layer's K/V are written)."""
        out = self._get_out(request_id)
        with out.lock:
            self._send_layer(out, layer)

    def _send_layer(self, out: _Outbound, layer: int) -> None:
        if layer in out.sent_layers or out.broken is not None:
            return
        out.sent_layers.add(layer)
        session = out.session
        assert session is not None
        for plan in out.plans:
            if plan.layer != layer:
                continue
            if out.aborted is not None:
                raise KVTransferError(TransferStatus.ABORTED, out.aborted, out.request_id)
            n = self.faults.tick()
            if self.faults.drop(out.attempt, plan.seq, len(out.plans), n):
                continue
            views = chunk_views(self.cache, out.block_ids, plan)
            info = chunk_info(out.request_id, plan, views)
            views = self.faults.views(out.attempt, plan.seq, views, n)
            if self.faults.chunk_delay_s:
                time.sleep(self.faults.chunk_delay_s)
            try:
                self._busy(out, lambda s=session, p=plan, iv=(info, views): s.send_chunk(p, iv))
            except KVTransferError as e:
                if e.status.retryable:
                    out.broken = e  # the receiver has dropped this attempt; finish() retries
                    return
                raise
            out.metrics.chunks += 1
            out.metrics.bytes += info.nbytes

    def sent_layers(self, request_id: str) -> set[int]:
        """Layers of a send in progress already handed to the transport (empty when none is)."""
        with self.lock:
            out = self._outbound.get(request_id)
        return set(out.sent_layers) if out is not None else set()

    def finish(self, request_id: str, commit: bytes = b"") -> TransferMetrics:
        """Send the layers not yet sent and the commit, wait for the acknowledgement (retrying a damaged
        transfer up to ``max_retries`` times) and free the sender's blocks. Raises KVTransferError on failure."""
        out = self._get_out(request_id)
        error: KVTransferError | None = None
        try:
            with out.lock:
                while True:
                    for layer in range(self.cache.spec.num_layers):
                        self._send_layer(out, layer)
                    session = out.session
                    assert session is not None
                    if out.broken is not None:
                        session.cancel()
                        status, detail = out.broken.status, out.broken.detail
                    else:
                        status, detail = self._busy(out, lambda s=session: s.finish(commit))
                    if status is TransferStatus.OK:
                        break
                    if status.retryable and out.attempt <= self.config.max_retries and out.aborted is None:
                        log.warning(
                            "kv send %s attempt %d: %s (%s); retrying",
                            request_id,
                            out.attempt,
                            status.value,
                            detail,
                        )
                        self._totals["retries"] += 1
                        self._open_attempt(out)
                        continue
                    raise KVTransferError(status, detail, request_id)
        except KVTransferError as e:
            error = e
            raise
        except BaseException:
            error = KVTransferError(TransferStatus.UNAVAILABLE, "sender error", request_id)
            raise
        finally:
            self._end(out, error)
        return out.metrics

    def _get_out(self, request_id: str) -> _Outbound:
        with self.lock:
            out = self._outbound.get(request_id)
        if out is None:
            raise KVTransferError(TransferStatus.UNKNOWN, "no send in progress", request_id)
        return out

    def _end(self, out: _Outbound, error: KVTransferError | None) -> None:
        if error is not None and out.session is not None:
            out.session.cancel()
        with self.lock:
            self._outbound.pop(out.request_id, None)
        self.leases.release(out.request_id)
        m = out.metrics
        m.latency_s = time.perf_counter() - out.t0
        m.status = TransferStatus.OK.value if error is None else error.status.value
        self._metrics.append(m)
        self._totals["transfers_ok" if error is None else "transfers_failed"] += 1
        self._totals["bytes_sent"] += m.bytes if error is None else 0

    # -- abort ------------------------------------------------------------------------------------
    def abort(self, request_id: str, reason: str = "aborted", final: bool = False) -> bool:
        """Cancel ``request_id`` on this side (sending or receiving) and tell the peer. Frees this
        side's blocks; a send in progress raises KVTransferError(ABORTED) in its caller. ``final``: the
        request is gone for good here, so a later handshake for it is refused (a sender that had not heard
        yet would otherwise reserve blocks that nobody takes until the receive timeout)."""
        found = self.receiver.abort(request_id, reason, final)
        with self.lock:
            out = self._outbound.get(request_id)
        if out is not None:
            found = True
            self._cancel_outbound(out, reason)
        return found

    def _cancel_outbound(self, out: _Outbound, reason: str) -> None:
        out.aborted = reason
        try:
            self._abort_remote(out.peer, out.request_id, reason)
        except Exception as e:  # the peer also expires it on its own
            log.warning("kv abort of %s not delivered to %s: %s", out.request_id, out.peer, e)
        if out.session is not None:
            with contextlib.suppress(Exception):
                out.session.cancel()
        # Free now, even if a sending thread is still unwinding; _end() then finds nothing to free.
        self.leases.release(out.request_id)

    # -- housekeeping -----------------------------------------------------------------------------
    def _start_reaper(self) -> None:
        with self.lock:
            if self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap_loop, name=f"kv-reaper-{self.name}", daemon=True
                )
                self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._closed.wait(self.config.reap_interval_s):
            self.reap()

    def reap(self) -> None:
        for rid in self.leases.expire():
            with self.lock:
                out = self._outbound.get(rid)
            if out is not None:
                self._cancel_outbound(out, "sender lease expired")
        self.receiver.expire()

    def metrics(self) -> list[dict]:
        """Recent per-transfer metrics (newest last), plain dicts for the monitor."""
        return [m.as_dict() for m in list(self._metrics)]

    def stats(self) -> dict:
        return {
            "backend": self.name,
            **self._totals,
            "leases": len(self.leases),
            "sending": len(self._outbound),
            **self.receiver.stats(),
        }

    def close(self) -> None:
        self._closed.set()
        self._shutdown()
        if self._reaper is not None:
            self._reaper.join(timeout=2)

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
