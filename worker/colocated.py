"""The colocated worker: one engine does prefill and decode with continuous batching, no KV transfer.

The baseline the disaggregated cluster is measured against, and a sensible choice for one small device. It
speaks the same output protocol as the decode worker (per-consumer buffers drained by long-poll).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import replace

from engine.request import FinishReason, PriorityClass, Request, RequestOutput, RequestRejected
from worker.actor import EngineWorker
from worker.config import WorkerConfig
from worker.messages import RequestMessage
from worker.neighbour_cores import NeighbourCores

logger = logging.getLogger(__name__)


def admission_order(req: Request) -> tuple[int, int]:
    """Online before offline, then the smaller ``priority`` first; the engine keeps FCFS among equals.

    Colocated mode has no controller in front of the engine, so the priority classes the gateway assigns
    are applied here, where the backlog forms (the engine's waiting queue).
    """
    return (0 if req.priority_class == PriorityClass.ONLINE else 1, req.priority)


def with_step_budget(config: WorkerConfig, device: str) -> WorkerConfig:
    """``config`` with its engine's step token budget set to ``cpu_step_tokens`` when the engine runs on the
    CPU (``device``, resolved) and one is set; unchanged otherwise."""
    if config.cpu_step_tokens is None or device != "cpu":
        return config
    scheduler = replace(config.engine.scheduler, max_num_batched_tokens=config.cpu_step_tokens)
    return replace(config, engine=replace(config.engine, scheduler=scheduler))


class ColocatedWorker(EngineWorker):
    role = "colocated"

    def __init__(self, config: WorkerConfig) -> None:
        from engine.device import get_device

        config = with_step_budget(config, get_device(config.engine.device).name)
        super().__init__(config)
        self.engine.waiting_key = admission_order
        # Cores lent between the colocated workers of a node for long prompt chunks (None: not pinned, or alone).
        self._sharing: NeighbourCores | None = None
        if self.cores and config.neighbour_cores:
            self._sharing = NeighbourCores(
                self.engine,
                self.cores,
                config.num_threads,
                config.neighbour_cores,
                config.pause_neighbours_ms / 1e3,
            )
            self.engine.compute_cores = self._sharing
        self._inbox: queue.SimpleQueue[tuple[str, object, threading.Event | None]] = queue.SimpleQueue()
        self._consumer: dict[str, str] = {}
        self._start(self._loop)

    # ------------------------------------------------------------------ remote API
    def submit(self, msg: RequestMessage) -> None:
        self._inbox.put(("add", msg, None))

    def abort(self, request_id: str, wait_s: float = 2.0) -> bool:
        done = threading.Event()
        self._inbox.put(("abort", request_id, done))
        return done.wait(wait_s)

    def stats(self) -> dict:
        sharing = self._sharing
        return {
            **super().stats(),
            "waiting": len(self.engine.waiting),
            "core_shared_steps": sharing.widened_steps if sharing else 0,
            "neighbour_pausing_steps": sharing.pausing_steps if sharing else 0,
            # What a prompt token costs this worker on its own cores (0: not measured yet).
            "prompt_s_per_token": self.engine.step_clock.prompt_s_per_token or 0.0,
        }

    def shutdown(self) -> None:
        self._close()
        self._thread.join(timeout=5)
        if self._sharing is not None:
            self._sharing.close()

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        idle_checked = False
        while not self._closed.is_set():
            try:
                self._take_inbox(0.0 if self.engine.has_unfinished() else 0.01)
                if self.engine.has_unfinished():
                    idle_checked = False
                    self._step()
                elif not idle_checked:
                    self._check_integrity()
                    idle_checked = True
                    if self._sharing is not None:
                        self._sharing.post()  # idle: its cores are free to lend
            except Exception:
                logger.exception("colocated loop error")
                time.sleep(0.05)

    def _take_inbox(self, timeout: float) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: object, done: threading.Event | None) -> None:
        if kind == "add":
            assert isinstance(payload, RequestMessage)
            try:
                self.engine.add_request(payload.to_request())
                self._consumer[payload.request_id] = payload.consumer_id
                if self._sharing is not None:
                    self._sharing.post()  # a prompt to compute: its cores are no longer free to lend
            except (RequestRejected, ValueError) as e:
                err = RequestOutput(
                    payload.request_id, [], [], True, FinishReason.ERROR, payload.num_prompt_tokens, 0, str(e)
                )
                self.outputs.put(payload.consumer_id, [err])
        else:
            assert isinstance(payload, str)
            self.engine.abort(payload)
            self._consumer.pop(payload, None)
            if done is not None:
                done.set()

    def _step(self) -> None:
        outs = self._timed_step()
        routed = []
        for out in outs:
            consumer = self._consumer.get(out.request_id)
            if out.finished:
                self._consumer.pop(out.request_id, None)
            if consumer is not None:
                routed.append((consumer, out))
        self.outputs.put_many(routed)
        if self._sharing is not None and self.heartbeat.monitor is not None:
            for (
                lender
            ) in self._sharing.take_lenders():  # a few a second at most: steps with long prompt chunks
                self.heartbeat.monitor.record_core_lend.remote(lender)
        self.heartbeat.push()
