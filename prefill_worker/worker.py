"""The prefill worker: FCFS queue of bucketed prompt batches; computes KV and the first token, then hands each
request's blocks to its decode worker through the KV transport, in one transaction: the transfer's handshake asks
the decode worker for the room the request may grow to, its commit carries the prefilled request.

A plain class; the cluster launcher makes it a threaded Ray actor. The loop thread runs batches one after the
other (FCFS: the controller already ordered them); sender threads move KV while the next batch runs. The first
token goes straight to the gateway (through :meth:`drain`), so the time to first token does not wait for the
transfer.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray

from bucket_manager.dispatch_socket import DispatchListener
from bucket_manager.local_socket import this_node_id
from bucket_manager.request import RequestSummary
from engine.request import FinishReason, Request, RequestOutput
from kv_transfer import KVTransferError, TransferStatus
from kv_transfer.streaming import LayerStreamer
from monitor import stages
from monitor.records import BatchRecord
from worker.actor import EngineWorker
from worker.config import WorkerConfig, layer_streaming
from worker.core_gate import CoreGate
from worker.cores import borrowed_cores, extra_cores
from worker.info import DecodePeer
from worker.messages import MessageRef, PrefilledMessage, RequestMessage

logger = logging.getLogger(__name__)

# How long a batch may wait for blocks still leased to transfers before it is given back for re-planning.
BLOCK_WAIT_S = 30.0
# How long a decode worker whose KV port failed may take to answer on Ray before it is reported down.
PEER_CHECK_S = 5.0
# The most the loop waits for the gateways' waiting drain calls to take a batch's first tokens (they take them in
# well under a millisecond once they run; a gateway that is not waiting is not waited for).
FIRST_TOKEN_HAND_OVER_S = 0.005


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.transport = self._open_kv_transport()
        self._cond = threading.Condition()
        # (batch id, [(request, decode worker id)], when the controller sent it, cores it may borrow), in the order
        # to run them.
        self._queue: collections.deque[
            tuple[int, list[tuple[RequestMessage, str]], float | None, tuple[int, ...]]
        ] = collections.deque()
        self._core_shared = 0  # batches that ran on borrowed cores too
        # Borrowed cores -> their gate, opened once (loop only).
        self._gates: dict[tuple[int, ...], CoreGate] = {}
        self._in_progress = 0  # batches taken off the queue whose transfers are not all done
        # Every batch held here, queued or in progress, until its batch_done: what a restarted controller adopts.
        self._held: dict[int, list[tuple[RequestMessage, str]]] = {}
        self._streamed = 0  # transfers that went layer by layer during their prefill and were acknowledged
        self._stream_layers = layer_streaming(
            config.stream_kv_layers, self.engine.device.name, config.num_threads
        )
        logger.info(
            "%s sends KV %s",
            config.worker_id,
            "layer by layer during each prefill" if self._stream_layers else "after each prefill batch",
        )
        self._peers: dict[str, DecodePeer] = {}  # by decode worker id
        self._tombstones: dict[str, float] = {}
        self._senders = ThreadPoolExecutor(config.num_senders, thread_name_prefix="kv-send")
        self._monitor = self.heartbeat.monitor
        # The controller on this node hands batches over this socket rather than by Ray (faster by 1-2 ms).
        self.dispatch_socket = DispatchListener(self.enqueue, config.worker_id)
        self._start(self._loop)

    # ------------------------------------------------------------------ remote API
    def set_decode_workers(self, peers: dict[str, DecodePeer]) -> None:
        with self._cond:
            new = [p.kv_address for name, p in peers.items() if self._peers.get(name) != p]
            self._peers = dict(peers)
        if new:
            # Off the caller's thread: connecting is best effort, and the controller waits on this call.
            threading.Thread(target=self._prepare, args=(new,), name="kv-prepare", daemon=True).start()

    def dispatch_channel(self) -> tuple[str, str]:
        """``(node id, path)`` of this worker's dispatch socket: a controller on the same node sends batches there."""
        node = this_node_id()
        return node, self.dispatch_socket.path

    def _prepare(self, addresses: list[str]) -> None:
        for address in addresses:
            self.transport.prepare(address)

    def enqueue(
        self,
        batch_id: int,
        items: list[tuple[RequestMessage | MessageRef, str]],
        dispatched_at: float | None = None,
        borrow_cores: tuple[int, ...] = (),
    ) -> None:
        """A batch planned by the controller: (request, decode worker id) pairs, run after those queued;
        ``dispatched_at``: when the controller sent it (Unix seconds), stamped on the first tokens;
        ``borrow_cores``: cores of idle decode workers beside this one that its forward pass may run on too. Each
        request's message comes with the call, or is fetched here from its gateway's object store (a long prompt)."""
        msgs = self._fetch_messages([p for p, _ in items])
        items = [(m, d) for m, (_, d) in zip(msgs, items, strict=True) if m is not None]
        with self._cond:
            self._queue.append((batch_id, list(items), dispatched_at, tuple(borrow_cores)))
            self._held[batch_id] = list(items)
            self._cond.notify_all()

    def withdraw(self, batch_id: int) -> bool:
        """Give a queued batch back to the controller (it plans it again, for a decode worker that freed up):
        True if it was still waiting here, False if it has started or never came."""
        with self._cond:
            for i, (bid, *_) in enumerate(self._queue):
                if bid == batch_id:
                    del self._queue[i]
                    self._held.pop(batch_id, None)
                    return True
        return False

    def held_batches(self) -> list[tuple[int, list[tuple[RequestSummary, RequestMessage, str]]]]:
        """The batches held here, queued or in progress, each (batch id, [(summary, request, decode worker id)]),
        without the aborted requests: what a restarted controller rebuilds its ledger from."""
        with self._cond:
            return [
                (bid, [(m.summary(), m, d) for m, d in items if m.request_id not in self._tombstones])
                for bid, items in self._held.items()
            ]

    def abort(self, request_id: str) -> bool:
        """Forget the request: dropped if still queued, its blocks freed if its KV is being sent."""
        with self._cond:
            self._tombstones[request_id] = time.monotonic()
        return self.transport.abort(request_id, "aborted by client")

    def stats(self) -> dict:
        with self._cond:
            queued = len(self._queue)
        return {
            **super().stats(),
            "queued_batches": queued,
            "in_progress": self._in_progress,
            "streamed_transfers": self._streamed,
            "batches_by_socket": self.dispatch_socket.batches,
            "core_shared_batches": self._core_shared,
            "kv_layer_streaming": self._stream_layers,
            "transport": self.transport.stats(),
        }

    def shutdown(self) -> None:
        self.dispatch_socket.close()
        self._close()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._senders.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
        for gate in self._gates.values():
            gate.close()

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        while not self._closed.is_set():
            with self._cond:
                self._expire()
                if not self._queue:
                    self._cond.wait(0.5)
                    continue
                batch_id, items, dispatched_at, borrow = self._queue.popleft()
                self._in_progress += 1
                items = [(m, d) for m, d in items if m.request_id not in self._tombstones]
            streamer = LayerStreamer(self.transport) if self._stream_layers else None
            forward_s: float | None = None
            try:
                sends, forward_s = self._run(items, streamer, dispatched_at, borrow)
            except Exception as e:
                logger.exception("prefill batch %d failed", batch_id)
                sends = []
                for msg, _ in items:
                    self._give_back(msg, f"prefill failed: {e}")
            self._senders.submit(self._send_all, batch_id, sends, streamer, forward_s)

    def _gate(self, cores: tuple[int, ...]) -> CoreGate:
        """The gate of the cores a batch borrows (a no-op gate when it borrows none, or this worker is not pinned:
        then no core is widened onto either)."""
        key = tuple(sorted(set(extra_cores(self.cores, cores)))) if self.cores else ()
        gate = self._gates.get(key)
        if gate is None:
            gate = self._gates[key] = CoreGate(key)
        return gate

    def _run(
        self,
        items: list[tuple[RequestMessage, str]],
        streamer: LayerStreamer | None = None,
        dispatched_at: float | None = None,
        borrow_cores: tuple[int, ...] = (),
    ) -> tuple[list[tuple[RequestMessage, Request, str]], float | None]:
        """Prefill a batch: the hand-offs to make, and the forward pass's seconds (None when nothing ran)."""
        if not items:
            return [], None
        bs = self.engine.block_size
        need = sum(-(-m.num_prompt_tokens // bs) for m, _ in items)
        deadline = time.monotonic() + BLOCK_WAIT_S
        # Blocks of earlier requests are still leased to transfers: they come back on acknowledgement.
        while self.engine.allocator.num_free < need:
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefill needs {need} KV blocks, {self.engine.allocator.num_free} free")
            time.sleep(0.002)
        reqs = [m.to_request() for m, _ in items]
        if streamer is not None:
            self._begin_streams(items, reqs, streamer)
        gate = self._gate(borrow_cores)
        try:
            # Waits for the lenders' decode steps in progress (at most one each); they step again after the forward.
            # Not free in time (a stuck lender): on its own cores.
            with gate.borrow() as held:
                start = time.time()
                t0 = time.perf_counter()
                hook = streamer.on_layer_written if streamer is not None else None
                lent = borrow_cores if held else ()
                with borrowed_cores(self.cores, self.config.num_threads, lent) as threads:
                    # Back to its own cores as soon as the forward is done: the batch's requests decode on the lender.
                    outs = self.engine.prefill_only(reqs, on_layer_written=hook)
            self._core_shared += threads > self.config.num_threads
        except BaseException:
            # Every transfer opened (or refused) is ended, and the transport frees those requests' blocks.
            opened = set(streamer.abort("prefill failed")) if streamer is not None else set()
            for r in reqs:
                req = self.engine.detach(r.request_id)
                if r.request_id in opened:
                    req.block_ids = []  # the transport freed them, on this side and the decode worker's
                else:
                    self._drop(req)
            raise
        ms = (time.perf_counter() - t0) * 1e3
        self._latency_ms = ms if self._latency_ms is None else 0.8 * self._latency_ms + 0.2 * ms
        # The requests whose decode worker refused the handshake (full, unreachable) went through the forward pass
        # for nothing: their first token is not sent (a re-plan samples it again), their blocks are already freed.
        refused = streamer.begun() if streamer is not None else {}
        computed = list(zip(items, reqs, outs, strict=True))
        kept = [(item, r, o) for item, r, o in computed if r.request_id not in refused]
        marks = {stages.FORWARD_START: start, stages.FORWARD_END: start + ms / 1e3}
        if dispatched_at is not None:
            marks[stages.DISPATCHED] = dispatched_at
        # Handed over before this thread goes on (the batch's record, the KV send): the drain calls that carry the
        # first tokens to the gateways run on this worker's core too.
        self.outputs.put_many(
            ((m.consumer_id, o.marked(marks)) for (m, _), _, o in kept), hand_over_s=FIRST_TOKEN_HAND_OVER_S
        )
        self._record_batch(reqs)  # after the first tokens are out: the monitor is not on their way
        sends = []
        for (msg, decode_id), r, _ in kept:
            req = self.engine.detach(r.request_id)
            if req.finished:  # done at its first token (EOS, max_tokens=1): nothing to decode
                if streamer is not None and streamer.cancel(req.request_id, "finished at its first token"):
                    req.block_ids = []  # never committed: the decode worker frees what landed there
                else:
                    self._drop(req)
            else:
                sends.append((msg, req, decode_id))
        for (msg, decode_id), r, _ in computed:
            err = refused.get(r.request_id)
            if err is None:
                continue
            self.engine.detach(r.request_id).block_ids = []  # freed by the transport
            # Named: the gateway shows it, and it may be the first news of that worker's death to reach the client.
            full = decode_id if err.receiver_full else None
            down = decode_id if self._unreachable(decode_id, err) else None
            self._give_back(msg, f"KV transfer to {decode_id} refused: {err}", full_on=full, down=down)
        self.heartbeat.push()
        return sends, ms / 1e3

    def _begin_streams(
        self, items: list[tuple[RequestMessage, str]], reqs: list[Request], streamer: LayerStreamer
    ) -> None:
        """Allocate the batch's blocks and hand the streamer each request's handshake: its thread runs them while
        the forward pass computes, then sends the layers as they are written. A request whose decode worker is
        not known here opens no transfer: it goes the unstreamed way and fails there by name."""
        self.engine.allocate_prompts(reqs)
        opens = []
        for (msg, decode_id), r in zip(items, reqs, strict=True):
            peer = self._peers.get(decode_id)
            if peer is not None:
                opens.append(
                    (peer.kv_address, r.request_id, list(r.block_ids), r.num_tokens, msg.reserve_tokens)
                )
        streamer.begin_all(opens)

    def _drop(self, req: Request) -> None:
        if req.block_ids:
            self.engine.allocator.free(req.block_ids)
            req.block_ids = []

    def _record_batch(self, reqs: list[Request]) -> None:
        if self._monitor is None:
            return
        lengths = [r.num_prompt_tokens for r in reqs]
        padded = self.engine.padded_prompt_tokens(lengths)
        rec = BatchRecord(self.config.worker_id, "prefill", len(reqs), sum(lengths), padded, time.time())
        self._monitor.record_batch.remote(rec)

    # ------------------------------------------------------------------ sending
    def _send_all(
        self,
        batch_id: int,
        sends: list[tuple[RequestMessage, Request, str]],
        streamer: LayerStreamer | None = None,
        forward_s: float | None = None,
    ) -> None:
        try:
            for msg, req, decode_id in sends:
                try:
                    self._send(msg, req, decode_id, streamer)
                except Exception as e:
                    logger.exception("KV hand-off of %s failed", msg.request_id)
                    if streamer is not None and streamer.cancel(msg.request_id, "hand-off failed"):
                        req.block_ids = []
                    else:
                        self._drop(req)
                    self._give_back(msg, f"KV hand-off to {decode_id} failed: {e}")
        finally:
            if streamer is not None:
                # Whatever is left was not handed off (aborted meanwhile, say): aborted, never committed.
                streamer.abort("not handed off")
            with self._cond:
                self._in_progress -= 1
                self._held.pop(batch_id, None)
            controller = self._get_controller()
            if controller is not None:
                controller.batch_done.remote(self.config.worker_id, batch_id, forward_s)
            self.heartbeat.push()

    def _send(
        self, msg: RequestMessage, req: Request, decode_id: str, streamer: LayerStreamer | None = None
    ) -> None:
        """Hand one prefilled request to its decode worker: the rest of its KV and the commit (the prefilled
        request) on its transfer, which the decode worker admitted at the handshake (streamed: before the
        forward pass) or admits now. A refusal or failure gives the request back to the controller."""
        rid = msg.request_id
        streamed = streamer is not None and streamer.owns(rid)
        peer = self._peers.get(decode_id)
        if peer is None or self._aborted(rid):
            reason = "aborted" if peer is not None else f"unknown decode worker {decode_id}"
            if streamed:
                streamer.cancel(rid, reason)
                req.block_ids = []
            self._drop(req)
            if peer is None and not self._aborted(rid):
                self._give_back(msg, reason)
            return
        first_logprob = req.output_logprobs[0] if req.output_logprobs else None
        commit = PrefilledMessage(msg, req.output_token_ids[0], first_logprob).encode()
        try:
            # The transport owns the blocks from here (from the handshake, when streamed) and frees them on
            # acknowledgement or failure, on both sides.
            if streamed:
                result = streamer.finish([rid], {rid: commit})[rid]
                if isinstance(result, KVTransferError):
                    raise result
                with self._cond:
                    self._streamed += 1
            else:
                result = self.transport.send(
                    peer.kv_address,
                    rid,
                    req.block_ids,
                    req.num_computed_tokens,
                    req.output_token_ids[0],
                    commit=commit,
                    reserve_tokens=msg.reserve_tokens,
                )
            if self._monitor is not None:
                self._monitor.record_transfer.remote(
                    msg.priority_class,
                    result.bytes,
                    result.latency_s,
                    self.config.transfer.route_name(result.backend),
                )
        except KVTransferError as e:
            if not self._aborted(rid):
                # Full: back-pressure (the controller holds that worker a moment); unreachable: marked down.
                full = decode_id if e.receiver_full else None
                down = decode_id if self._unreachable(decode_id, e) else None
                self._give_back(msg, f"KV transfer to {decode_id} failed: {e}", full_on=full, down=down)
        req.block_ids = []

    def _unreachable(self, decode_id: str, error: KVTransferError) -> bool:
        """Whether a transfer failed because its decode worker is gone: its KV port did not answer, and neither
        does the actor (Ray knows a dead one at once). Only then is it marked down for the controller: a worker
        marked down gets no work until Ray restarts it, so a refusal or a broken stream alone does not."""
        if error.status not in (TransferStatus.UNAVAILABLE, TransferStatus.TIMEOUT):
            return False
        peer = self._peers.get(decode_id)
        if peer is None:
            return False
        try:
            ray.get(peer.handle.info.remote(), timeout=PEER_CHECK_S)
        except Exception:  # dead, or not answering either
            return True
        return False

    def _aborted(self, rid: str) -> bool:
        with self._cond:
            return rid in self._tombstones

    def _give_back(
        self, msg: RequestMessage, reason: str, full_on: str | None = None, down: str | None = None
    ) -> None:
        """Hand the request back to the controller to prefill again; fail it when it will not be retried.
        ``full_on``/``down``: the decode worker that refused it as full / did not answer (``Controller.requeue``)."""
        controller = self._get_controller()
        requeued = False
        if controller is not None:
            try:
                requeued = ray.get(
                    controller.requeue.remote(msg.request_id, reason, full_on, down), timeout=30
                )
            except Exception as e:
                logger.warning("controller unreachable for requeue of %s: %s", msg.request_id, e)
        if not requeued and not self._aborted(msg.request_id):
            err = RequestOutput(
                msg.request_id, [], [], True, FinishReason.ERROR, msg.num_prompt_tokens, 0, error=reason
            )
            self.outputs.put(msg.consumer_id, [err])

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, t in self._tombstones.items() if now - t > self.config.tombstone_ttl_s]:
            del self._tombstones[rid]

    def _queue_len(self) -> int:
        with self._cond:
            return len(self._queue) + self._in_progress
