"""Layer streaming: move a prefill batch's KV to its decode peers while the batch still computes.

The engine calls ``on_layer_written(layer)`` as soon as a layer's K/V are in the paged cache
(``LLMEngine.prefill_only(reqs, on_layer_written=...)``). :class:`LayerStreamer` hands that layer to
one sender thread and returns at once, so the forward pass is never blocked on the network; the
thread sends the layer's chunks of every request in the batch. After the forward pass only the
layers not yet sent (normally the last one) and the acknowledgement remain::

    streamer = LayerStreamer(transport)
    for req, peer in batch:                          # blocks must exist before the first layer
        streamer.begin(peer, req.request_id, req.block_ids, req.num_tokens)
    outs = engine.prefill_only(reqs, on_layer_written=streamer.on_layer_written)
    results = streamer.finish(commits=commits)       # request id -> TransferMetrics or KVTransferError

The handshakes can also run while the forward pass computes (:meth:`begin_all`, then :meth:`begun` once the
pass is over): the sender thread handshakes each request first, then sends the layers as they come, so the
time to first token does not wait on the decode side's answer. A request its peer refused then went through
the forward pass for nothing; :meth:`begun` names it, and its blocks are already freed::

    streamer.begin_all([(peer, req.request_id, req.block_ids, req.num_tokens, reserve) for req, peer in batch])
    outs = engine.prefill_only(reqs, on_layer_written=streamer.on_layer_written)
    refused = streamer.begun()                       # request id -> KVTransferError

The first token is sampled only after the last layer, so the handshake of a streamed transfer
carries ``first_token = -1`` (:data:`FIRST_TOKEN_PENDING`); the commit that :meth:`finish` sends last carries
it, with the rest of what the decode side runs the request on. Ownership of the blocks is the transport's from :meth:`begin` on
(freed on acknowledgement, failure, abort or lease expiry), exactly as with ``KVTransport.send``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .types import KVTransferError, TransferMetrics, TransferStatus

if TYPE_CHECKING:  # the transports (and torch) load with the worker that opens one
    from .base import KVTransport

# One transfer to open: (peer, request id, block ids, number of tokens, tokens to reserve on the peer).
_Begin = tuple[str, str, Sequence[int], int, int]

log = logging.getLogger(__name__)

# Handshake ``first_token`` of a transfer that starts before the first token is sampled.
FIRST_TOKEN_PENDING = -1


class LayerStreamer:
    """Streams the KV of one prefill batch layer by layer; one instance per batch."""

    def __init__(self, transport: KVTransport) -> None:
        self.transport = transport
        self._started: list[str] = []
        self._errors: dict[str, KVTransferError] = {}
        self._cancelled: set[str] = set()
        # Work for the sender thread, in order: the batch's handshakes (begin_all), then the layers written by
        # the engine and not yet sent (at most num_layers), then the stop marker.
        self._layers: queue.Queue[int | list[_Begin] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._finished = False
        self._begins: threading.Event | None = None  # set once begin_all's handshakes are all done
        self._refused: dict[str, KVTransferError] = {}

    @property
    def request_ids(self) -> list[str]:
        return list(self._started)

    def begin(
        self,
        peer: str,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        first_token: int = FIRST_TOKEN_PENDING,
        reserve_tokens: int = 0,
    ) -> bool:
        """Lease ``block_ids`` and handshake now, before the compute. Returns False when the peer
        refused (the error is kept for :meth:`finish`; the blocks are already freed, as with
        ``send``). Call it for every request before the engine reports layer 0."""
        if self._finished:
            raise RuntimeError("LayerStreamer.begin after finish")
        try:
            self.transport.begin_send(peer, request_id, block_ids, num_tokens, first_token, reserve_tokens)
        except KVTransferError as e:
            self._errors[request_id] = e
            return False
        self._started.append(request_id)
        return True

    def begin_all(self, transfers: Sequence[_Begin]) -> None:
        """Lease and handshake each (peer, request id, block ids, num tokens, tokens to reserve) in the sender
        thread, ahead of the
        layers, and return at once: the forward pass runs meanwhile. Call :meth:`begun` before relying on which
        requests started. Ownership of each request's blocks passes to the transport when its handshake runs."""
        if self._finished or self._begins is not None:
            raise RuntimeError("LayerStreamer.begin_all: once per batch, before finish")
        self._begins = threading.Event()
        if not transfers:
            self._begins.set()
            return
        self._ensure_thread()
        self._layers.put(list(transfers))

    def begun(self) -> dict[str, KVTransferError]:
        """Wait for :meth:`begin_all`'s handshakes; the requests their peer refused (their blocks are freed, they
        are not streamed), each with its error. Empty when begin_all was not called."""
        if self._begins is not None:
            self._begins.wait()
        return dict(self._refused)

    def on_layer_written(self, layer: int) -> None:
        """The engine's per-layer hook: queue the layer for the sender thread, never block."""
        if self._finished:  # after finish() the rest goes with finish itself
            return
        if not self._started and (self._begins is None or self._begins.is_set()):
            return  # nothing opened, and no handshake still to run: nothing to send
        self._ensure_thread()
        self._layers.put(layer)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-layer-stream", daemon=True)
                self._thread.start()

    def _begin_each(self, transfers: list[_Begin]) -> None:
        try:
            for peer, rid, block_ids, num_tokens, reserve in transfers:
                try:
                    self.begin(peer, rid, block_ids, num_tokens, reserve_tokens=reserve)
                except Exception as e:  # begin_send raises KVTransferError only; anything else is a bug there
                    log.exception("kv handshake of %s", rid)
                    self._errors[rid] = KVTransferError(TransferStatus.UNAVAILABLE, repr(e), rid)
                if rid in self._errors:
                    self._refused[rid] = self._errors.pop(rid)
        finally:
            assert self._begins is not None
            self._begins.set()

    def _run(self) -> None:
        while True:
            layer = self._layers.get()
            if layer is None:
                return
            if isinstance(layer, list):
                self._begin_each(layer)
                continue
            for rid in self._started:
                if rid in self._errors:
                    continue
                try:
                    self.transport.send_layer(rid, layer)
                except KVTransferError as e:
                    # Aborted or failed for good: finish() reports it (the transport freed the blocks).
                    self._errors[rid] = e
                except Exception as e:  # keep streaming the batch's other requests
                    log.exception("kv layer stream of %s, layer %d", rid, layer)
                    self._errors[rid] = KVTransferError(TransferStatus.UNAVAILABLE, repr(e), rid)
                    self.transport.abort(rid, "sender error")

    def _stop_thread(self) -> None:
        # Called once the forward pass is over (every hook has run): send what is queued, then stop.
        self._finished = True
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._layers.put(None)
            thread.join()

    def finish(
        self, request_ids: Sequence[str] | None = None, commits: Mapping[str, bytes] | None = None
    ) -> dict[str, TransferMetrics | KVTransferError]:
        """Wait for the queued layers, send whatever was not sent (every layer when the engine ran
        without the hook) and each request's commit (``commits``, empty for a request not named), then wait for
        the acknowledgement of ``request_ids`` (default: the requests of ``commits``, or with neither, every
        request not yet finished or cancelled). Never raises for one request; a request the peer refused at
        :meth:`begin` is reported with its error."""
        self._stop_thread()
        commits = commits or {}
        if request_ids is None:
            request_ids = list(commits) if commits else list(self._started) + list(self._errors)
        wanted = list(request_ids)
        results: dict[str, TransferMetrics | KVTransferError] = {}
        for rid in dict.fromkeys(wanted):
            if rid in self._started:
                self._started.remove(rid)
                try:
                    # Also for a request that failed while streaming: this ends its bookkeeping.
                    metrics = self.transport.finish(rid, commits.get(rid, b""))
                except KVTransferError as e:
                    results[rid] = self._errors.pop(rid, e)
                else:
                    results[rid] = self._errors.pop(rid, metrics)
            elif rid in self._errors:
                results[rid] = self._errors.pop(rid)
            else:
                results[rid] = KVTransferError(TransferStatus.UNKNOWN, "not streamed", rid)
        return results

    def owns(self, request_id: str) -> bool:
        """True while the transport holds this request's blocks for a streamed send."""
        return request_id in self._started and request_id not in self._cancelled

    def cancel(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort one streamed send (the decode side refused it, the client left): frees its blocks
        on both sides. False when this streamer does not hold it (the caller still owns its blocks)."""
        if not self.owns(request_id):
            return False
        self._cancelled.add(request_id)
        self._errors.setdefault(request_id, KVTransferError(TransferStatus.ABORTED, reason, request_id))
        self.transport.abort(request_id, reason)
        # Its bookkeeping ends now, not with the batch: the transport knows transfers by request id, and the
        # request may be planned again (and opened again on this transport) before the batch's last finish().
        self.finish([request_id])
        return True

    def abort(self, reason: str = "aborted") -> dict[str, TransferMetrics | KVTransferError]:
        """Cancel every transfer of the batch (e.g. the prefill failed): frees blocks on both sides;
        returns what :meth:`finish` would, the requests refused at their handshake included."""
        self._errors.update(self.begun())  # every handshake done first: none may start after the aborts
        for rid in list(self._started):
            if rid not in self._errors:
                self._errors[rid] = KVTransferError(TransferStatus.ABORTED, reason, rid)
                self.transport.abort(rid, reason)
        return self.finish()
