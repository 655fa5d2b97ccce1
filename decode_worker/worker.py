"""The decode worker: receives prefilled requests' KV and runs continuous batching over decode buckets.

A plain class; the cluster launcher turns it into a threaded Ray actor (``ray.remote(...)`` with
``max_concurrency``) so ``drain`` long-polls and ``abort`` are served while the loop thread steps.

Only the loop thread touches the engine; other threads hand it aborts through a queue. A request arrives in one
transaction, the KV transfer: its handshake asks for the room the request may grow to here (admitted or refused
as full at that moment, against everything already promised), its commit carries the prefilled request (first
token, sampling, the gateway that drains it). The loop takes the completed transfer and ``admit_prefilled`` s the
request into the running batch at the next step. Nothing arrives in two parts, so nothing waits here for its
other half.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

import ray

from engine.request import FinishReason, RequestOutput, RequestRejected
from kv_transfer import Handshake, ReceivedKV
from monitor import stages
from worker.actor import EngineWorker
from worker.config import WorkerConfig
from worker.core_gate import CoreGate
from worker.info import DecodePeer, WorkerInfo
from worker.messages import MessageRef, PrefilledMessage, RequestMessage

logger = logging.getLogger(__name__)

# How long the loop waits for a KV hand-off while it has nothing to decode: arrivals, lent batches and aborts wake
# it at once, so this only paces the idle checks (100 wake-ups a second cost an idle worker 30 ms of CPU a second
# on a 2-core host).
IDLE_WAIT_S = 0.25


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.transport = self._open_kv_transport()
        # The KV receiver's lock guards the dicts below too (not the engine: only the loop uses it): a handshake
        # is admitted against them and the receiver's own transfers at one moment.
        self._lock = self.transport.lock
        # Request id -> blocks it may grow to (prompt + max_tokens), from when the loop takes it (its transfer's
        # reservation until then is the receiver's, ``KVReceiver.arriving``) until it ends.
        self._reserved: dict[str, int] = {}
        self._consumer: dict[str, str] = {}  # request id -> consumer that drains its outputs
        self._tombstones: dict[str, float] = {}
        self._aborts: queue.SimpleQueue[tuple[str, threading.Event]] = queue.SimpleQueue()
        # Request id -> when the loop took its KV into the engine, until its first output here carries it (loop only).
        self._joined_at: dict[str, float] = {}
        # Prompt batches the controller lent this worker (elastic prefill), until the loop adds them to the engine.
        self._lent_in: queue.SimpleQueue[tuple[int, list[RequestMessage], float]] = queue.SimpleQueue()
        # Lent batch id -> its requests whose first token is not out yet; request id -> (its batch, when the
        # controller sent it) (loop only).
        self._lent: dict[int, set[str]] = {}
        self._lent_batch: dict[str, tuple[int, float]] = {}
        # Each step holds this worker's cores; a prefill worker beside it that borrows them holds them instead for
        # its forward pass, and the step waits (bucket_manager/lending.py, worker/core_gate.py).
        self._gate = CoreGate(self.cores)
        # Admission in place before the port opens: no handshake is taken unjudged.
        self.transport.receiver.admission = self._admit_transfer
        self.address = self.transport.serve()
        self._start(self._loop)

    # ------------------------------------------------------------------ remote API
    def info(self) -> WorkerInfo:
        return dataclasses.replace(super().info(), address=self.address)

    def peer(self) -> DecodePeer:
        """This worker as prefill workers reach it (its address changes when Ray restarts it)."""
        return DecodePeer(ray.get_runtime_context().current_actor, self.address)

    def run_prompts(
        self, batch_id: int, payloads: list[RequestMessage | MessageRef], dispatched_at: float | None = None
    ) -> None:
        """A batch of prompts the controller lends this worker while it has slack (``bucket_manager/lending.py``):
        prefilled in its own engine steps (no KV transfer: the blocks are its own), then decoded here. The
        controller hears ``batch_done`` once every prompt of it has its first token (or has ended)."""
        msgs = [m for m in self._fetch_messages(payloads) if m is not None]
        kept = []
        with self._lock:
            for m in msgs:
                if m.request_id in self._tombstones:
                    continue
                self._reserved[m.request_id] = self._blocks_for(m.reserve_tokens)
                self._consumer[m.request_id] = m.consumer_id
                kept.append(m)
        self._lent_in.put((batch_id, kept, time.time() if dispatched_at is None else dispatched_at))
        self.transport.receiver.wake()

    def abort(self, request_id: str, wait_s: float = 2.0) -> bool:
        """Drop the request wherever it is here (arriving, running); waits until its blocks are free. Final: a
        handshake for it that comes later is refused."""
        with self._lock:
            self._tombstones[request_id] = time.monotonic()
        self.transport.abort(request_id, "aborted by client", final=True)
        done = threading.Event()
        self._aborts.put((request_id, done))
        self.transport.receiver.wake()
        return done.wait(wait_s)

    def held_requests(self) -> dict[str, int]:
        """Requests arriving or running here (request id -> blocks each may grow to), without aborted ones: what
        a restarted controller rebuilds this worker's reservations from."""
        with self._lock:
            arriving = {
                rid: self._blocks_for(tokens, blocks)
                for rid, (blocks, tokens) in self.transport.receiver.arriving().items()
            }
            held = {**arriving, **self._reserved}
            return {rid: n for rid, n in held.items() if rid not in self._tombstones}

    def stats(self) -> dict:
        return {
            **super().stats(),
            "arriving": len(self.transport.receiver.arriving()),
            "transport": self.transport.stats(),
        }

    def shutdown(self) -> None:
        self._close()
        self.transport.receiver.wake()
        self._thread.join(timeout=5)
        self.transport.close()
        self._gate.close()

    # ------------------------------------------------------------------ loop
    def _blocks_for(self, tokens: int, held: int = 0) -> int:
        """Blocks a request of ``tokens`` (prompt + max_tokens) may grow to here, and never fewer than the
        ``held`` it has already."""
        return max(
            held, -(-min(tokens, self.engine.config.scheduler.max_model_len) // self.engine.block_size)
        )

    def _available_blocks(self) -> int:
        """Free blocks not yet promised to arriving or running requests (caller holds the lock): each may still
        grow to its reservation from what it holds."""
        running = {r.request_id: len(r.block_ids) for r in list(self.engine.running)}
        promised = sum(max(0, need - running.get(rid, 0)) for rid, need in self._reserved.items())
        for rid, (blocks, tokens) in self.transport.receiver.arriving().items():
            if rid not in self._reserved:
                promised += max(0, self._blocks_for(tokens) - blocks)
        return self.engine.allocator.num_free - promised

    def _admit_transfer(self, hs: Handshake, kv_blocks: int) -> bool:
        """The KV receiver's question at a handshake (under the lock, before it allocates ``kv_blocks``): is
        there room for the request to grow to its reservation? No: the sender hears FULL, and the controller
        places the request elsewhere or later."""
        return self._blocks_for(hs.reserve_tokens, kv_blocks) <= self._available_blocks()

    def _loop(self) -> None:
        idle_checked = False
        while not self._closed.is_set():
            try:
                self._apply_aborts()
                busy = self.engine.has_unfinished()
                self._admit(0.0 if busy else IDLE_WAIT_S)
                if self.engine.has_unfinished():
                    idle_checked = False
                    self._step()
                elif not idle_checked and self._idle():
                    self._check_integrity()
                    idle_checked = True
                self._expire()
            except Exception:  # keep serving the other requests; the error is in the log
                logger.exception("decode loop error")
                time.sleep(0.05)

    def _idle(self) -> bool:
        return self.transport.receiver.is_idle()

    def _step(self) -> None:
        with self._gate.step():
            outs = self._timed_step()
        if self._joined_at:
            outs = self._stamp_joins(outs)
        if self._lent_batch:
            outs = self._stamp_lent(outs)
        routed = []
        finished = []
        with self._lock:
            for out in outs:
                consumer = self._consumer.get(out.request_id)
                if out.finished:
                    self._consumer.pop(out.request_id, None)
                    self._reserved.pop(out.request_id, None)
                    finished.append(out.request_id)
                if consumer is not None:
                    routed.append((consumer, out))
        self.outputs.put_many(routed)
        # The controller's reservation ends with the request, here, where it ends: a gateway that went away
        # (crashed, redeployed) would never release it. The gateway's own release after its last output is then a
        # no-op.
        controller = self._get_controller() if finished else None
        if controller is not None:
            for rid in finished:
                controller.release.remote(rid)
        self.heartbeat.push()

    def _stamp_lent(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """The first output of a lent request carries when the controller sent its batch (the forward marks come
        from the step); each first token (or end) counts down its batch."""
        stamped = []
        for out in outs:
            lent = self._lent_batch.get(out.request_id)
            if lent is not None and (out.has_first_token or out.finished):
                if out.has_first_token:
                    out = out.marked({stages.DISPATCHED: lent[1]})
                self._lent_started(out.request_id)
            stamped.append(out)
        return stamped

    def _stamp_joins(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """The first output here of each request just joined carries when its KV was taken and when this step
        ended: the hand-off stages (``monitor/stages.py``)."""
        now = time.time()
        stamped = []
        for out in outs:
            joined = self._joined_at.pop(out.request_id, None)
            if joined is not None:
                out = out.marked({stages.KV_RECEIVED: joined, stages.DECODE_FIRST: now})
            stamped.append(out)
        return stamped

    def _take_lent(self) -> None:
        """Add the lent prompt batches to the engine (loop thread only): its scheduler prefills them in chunks
        mixed into the decode steps."""
        while True:
            try:
                batch_id, msgs, dispatched_at = self._lent_in.get_nowait()
            except queue.Empty:
                return
            pending = set()
            for m in msgs:
                with self._lock:
                    if m.request_id in self._tombstones:
                        self._reserved.pop(m.request_id, None)
                        self._consumer.pop(m.request_id, None)
                        continue
                try:
                    self.engine.add_request(m.to_request())
                except (RequestRejected, ValueError) as e:
                    with self._lock:
                        self._reserved.pop(m.request_id, None)
                        self._consumer.pop(m.request_id, None)
                    err = RequestOutput(
                        m.request_id, [], [], True, FinishReason.ERROR, m.num_prompt_tokens, 0, error=str(e)
                    )
                    self.outputs.put(m.consumer_id, [err])
                    continue
                pending.add(m.request_id)
                self._lent_batch[m.request_id] = (batch_id, dispatched_at)
            self._lent[batch_id] = pending
            if not pending:
                self._lent_done(batch_id)

    def _lent_started(self, request_id: str) -> None:
        """A lent request has its first token (or has ended): its batch is done once all of them have."""
        lent = self._lent_batch.pop(request_id, None)
        if lent is None:
            return
        batch_id = lent[0]
        pending = self._lent.get(batch_id)
        if pending is not None:
            pending.discard(request_id)
            if not pending:
                self._lent_done(batch_id)

    def _lent_done(self, batch_id: int) -> None:
        self._lent.pop(batch_id, None)
        controller = self._get_controller()
        if controller is not None:
            controller.batch_done.remote(self.config.worker_id, batch_id)

    def _admit(self, timeout: float) -> None:
        self._take_lent()
        kv = self.transport.receive(timeout)
        while kv is not None:
            self._join(kv)
            kv = self.transport.receive(0.0)

    def _join(self, kv: ReceivedKV) -> None:
        """A completed transfer: its commit is the prefilled request, its reservation moves to this worker's
        ledger, and the request joins the running batch."""
        rid = kv.request_id
        try:
            msg = PrefilledMessage.decode(kv.commit)
            if msg.request.request_id != rid:
                raise ValueError(f"the commit is {msg.request.request_id!r}'s")
        except ValueError as e:
            # Only a sender that is not a prefill worker of this cluster commits so; nobody to tell but the log.
            logger.error(
                "KV of %s came with no prefilled request in its commit (%s); its blocks are freed", rid, e
            )
            self.engine.allocator.free(kv.block_ids)
            return
        with self._lock:
            if rid in self._tombstones:
                self.engine.allocator.free(kv.block_ids)
                return
            self._reserved[rid] = self._blocks_for(kv.reserve_tokens, len(kv.block_ids))
            self._consumer[rid] = msg.request.consumer_id
        req = msg.to_request(kv.block_ids, kv.num_tokens)
        self.engine.admit_prefilled(req)
        self._joined_at[rid] = time.time()

    def _apply_aborts(self) -> None:
        while True:
            try:
                rid, done = self._aborts.get_nowait()
            except queue.Empty:
                return
            self.engine.abort(rid)
            self._joined_at.pop(rid, None)
            self._lent_started(rid)
            self.transport.abort(rid, "aborted by client", final=True)
            with self._lock:
                self._reserved.pop(rid, None)
                self._consumer.pop(rid, None)
            done.set()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            ttl = self.config.tombstone_ttl_s
            for rid in [r for r, t in self._tombstones.items() if now - t > ttl]:
                del self._tombstones[rid]

    def _check_integrity(self) -> None:
        if not super()._check_integrity() and not self._idle():
            self._integrity_error = None  # a transfer started meanwhile and holds blocks: not a leak

    def _queue_len(self) -> int:
        return len(self.transport.receiver.arriving())
