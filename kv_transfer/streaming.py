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

import contextlib
import logging
import queue
import threading
from collections.abc import Sequence

from .base import KVTransport
from .types import KVTransferError, TransferMetrics, TransferStatus

log = logging.getLogger(__name__)

# Handshake ``first_token`` of a transfer that starts before the first token is sampled.
FIRST_TOKEN_PENDING = -1


class LayerStreamer:
    """Streams the KV of one prefill batch layer by layer; one instance per batch."""

    def __init__(self, transport: KVTransport) -> None:
        self.transport = transport
        self._started: list[str] = []
        self._errors: dict[str, KVTransferError] = {}
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
        if not self._started:
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

    def finish(self) -> dict[str, TransferMetrics | KVTransferError]:
        """Wait for the queued layers, send whatever was not sent (every layer when the engine ran
        without the hook), then wait for each acknowledgement. Never raises for one request."""
        self._finished = True
        with self._lock:
            thread = self._thread
        if thread is not None:
            self._layers.put(None)
            thread.join()
        results: dict[str, TransferMetrics | KVTransferError] = dict(self._errors)
        for rid in self._started:
            try:
                # Also for a request that failed while streaming: finish() ends its bookkeeping.
                metrics = self.transport.finish(rid)
            except KVTransferError as e:
                results.setdefault(rid, e)
            else:
                results.setdefault(rid, metrics)
        return results

    def abort(self, reason: str = "aborted") -> None:
        """Cancel every transfer of the batch (e.g. the prefill failed): frees blocks on both sides."""
        self._finished = True
        for rid in self._started:
            if rid not in self._errors:
                self.transport.abort(rid, reason)
                self._errors[rid] = KVTransferError(TransferStatus.ABORTED, reason, rid)
        with self._lock:
            thread = self._thread
        if thread is not None:
            self._layers.put(None)
            thread.join()
        for rid in self._started:
            with contextlib.suppress(KVTransferError):  # ends the transport's bookkeeping of the send
                self.transport.finish(rid)
        self._started = []
