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
    results = streamer.finish()                      # request id -> TransferMetrics or KVTransferError

The first token is sampled only after the last layer, so the handshake of a streamed transfer
carries ``first_token = -1`` (:data:`FIRST_TOKEN_PENDING`); the decode side takes the token from the
request's announcement instead. Ownership of the blocks is the transport's from :meth:`begin` on
(freed on acknowledgement, failure, abort or lease expiry), exactly as with ``KVTransport.send``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .types import KVTransferError, TransferMetrics, TransferStatus

if TYPE_CHECKING:  # the transports (and torch) load with the worker that opens one
    from .base import KVTransport

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
        # Layers written by the engine and not yet sent (at most num_layers + the stop marker).
        self._layers: queue.Queue[int | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._finished = False

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
    ) -> bool:
        """Lease ``block_ids`` and handshake now, before the compute. Returns False when the peer
        refused (the error is kept for :meth:`finish`; the blocks are already freed, as with
        ``send``). Call it for every request before the engine reports layer 0."""
        if self._finished:
            raise RuntimeError("LayerStreamer.begin after finish")
        try:
            self.transport.begin_send(peer, request_id, block_ids, num_tokens, first_token)
        except KVTransferError as e:
            self._errors[request_id] = e
            return False
        self._started.append(request_id)
        return True

    def on_layer_written(self, layer: int) -> None:
        """The engine's per-layer hook: queue the layer for the sender thread, never block."""
        if not self._started or self._finished:  # after finish() the rest goes with finish itself
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-layer-stream", daemon=True)
                self._thread.start()
        self._layers.put(layer)

    def _run(self) -> None:
        while True:
            layer = self._layers.get()
            if layer is None:
                return
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
        self, request_ids: Sequence[str] | None = None
    ) -> dict[str, TransferMetrics | KVTransferError]:
        """Wait for the queued layers, send whatever was not sent (every layer when the engine ran
        without the hook), then wait for the acknowledgement of ``request_ids`` (default: every
        request not yet finished or cancelled). Never raises for one request; a request the peer
        refused at :meth:`begin` is reported with its error."""
        self._stop_thread()
        wanted = list(self._started) + list(self._errors) if request_ids is None else list(request_ids)
        results: dict[str, TransferMetrics | KVTransferError] = {}
        for rid in dict.fromkeys(wanted):
            if rid in self._started:
                self._started.remove(rid)
                try:
                    # Also for a request that failed while streaming: this ends its bookkeeping.
                    metrics = self.transport.finish(rid)
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
        if self._finished:
            self.finish([request_id])
        return True

    def abort(self, reason: str = "aborted") -> dict[str, TransferMetrics | KVTransferError]:
        """Cancel every transfer of the batch (e.g. the prefill failed): frees blocks on both sides;
        returns what :meth:`finish` would."""
        for rid in list(self._started):
            if rid not in self._errors:
                self._errors[rid] = KVTransferError(TransferStatus.ABORTED, reason, rid)
                self.transport.abort(rid, reason)
        return self.finish()
