"""The bucketing controller: a thin Ray actor around the pure policies of this package.

It owns the queue of requests waiting for prefill (:class:`RequestBuckets`, Algorithm 1), re-runs
``adjust`` as the queue changes, forms batches with :func:`plan_batch` from the monitor's latest figures and
its own reservations, picks the prefill worker (shortest queue) and the decode worker (most free KV blocks) with
:func:`choose_workers`, and dispatches. It speaks in :class:`RequestSummary` and ids; the full request travels as
an opaque payload it hands to the prefill worker untouched. Workers are reached by actor handle only.

Memory accounting: a dispatched request reserves its prompt's blocks on its prefill worker until the batch's
KV has left (``batch_done``) and ``prompt + max_tokens`` blocks on its decode worker until it finishes
(``release``), so the budget never counts a block twice even when the monitor's figures lag a step behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from bucket_manager.batch_plan import BatchPlan, plan_batch
from bucket_manager.memory_budget import MemoryBudget, WorkerStats, blocks_for, choose_workers
from bucket_manager.priority import PriorityPolicy
from bucket_manager.request import PriorityClass, RequestSummary
from bucket_manager.request_buckets import RequestBuckets
from bucket_manager.shape_buckets import ShapeBucketConfig, ShapeBuckets

logger = logging.getLogger(__name__)

# ``buckets``: adaptive request buckets and the priority policy (the product). ``fcfs``: one bucket, served in
# arrival order whatever the class or priority (the DistServe-like baseline the benchmarks compare against).
SCHEDULING = ("buckets", "fcfs")


def _arrival_order(request: RequestSummary) -> tuple[float, ...]:
    return (request.arrival,)


@dataclass(frozen=True)
class ControllerConfig:
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    shape_config: ShapeBucketConfig
    monitor_name: str | None = None
    policy: PriorityPolicy = field(default_factory=PriorityPolicy)
    theta: float = 0.5
    # Batches a prefill worker may hold (one running, one queued): the rest wait here, where priorities apply.
    max_batches_per_prefill_worker: int = 2
    # How often the monitor's figures are re-read, and the planner wakes when nothing happens.
    stats_refresh_s: float = 0.1
    plan_interval_s: float = 0.05
    # Prefill attempts of one request (a decode worker refused or died, a transfer failed) before it fails.
    max_attempts: int = 4
    scheduling: str = "buckets"

    def __post_init__(self) -> None:
        if self.scheduling not in SCHEDULING:
            raise ValueError(
                f"ControllerConfig.scheduling must be one of {SCHEDULING}, got {self.scheduling!r}"
            )
        for name in (
            "block_size",
            "max_model_len",
            "max_num_batched_tokens",
            "max_batches_per_prefill_worker",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ControllerConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"ControllerConfig.max_attempts must be an int >= 1, got {self.max_attempts!r}")
        for name in ("stats_refresh_s", "plan_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"ControllerConfig.{name} must be > 0, got {value!r}")
        if not 0.0 <= self.theta < 1.0:
            raise ValueError(f"ControllerConfig.theta must be in [0, 1), got {self.theta!r}")
        if not isinstance(self.shape_config, ShapeBucketConfig):
            raise ValueError("ControllerConfig.shape_config must be a ShapeBucketConfig")


@dataclass
class _Worker:
    worker_id: str
    handle: Any
    total_blocks: int
    reserved: dict[str, int] = field(default_factory=dict)  # request id -> blocks promised
    outstanding: dict[int, tuple[str, ...]] = field(default_factory=dict)  # prefill: batch id -> request ids
    alive: bool = True

    def free_blocks(self, reported_free: int | None) -> int:
        own = self.total_blocks - sum(self.reserved.values())
        return max(0, own if reported_free is None else min(own, reported_free))


class Controller:
    """Run as a named async Ray actor (``ray.remote(Controller).options(name=...)``)."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.shapes = ShapeBuckets(config.shape_config)
        self.fcfs = config.scheduling == "fcfs"
        self.queue = RequestBuckets(
            config.max_model_len,
            self.shapes.prompt_query_lens,
            config.theta,
            key=_arrival_order if self.fcfs else config.policy.key,
        )
        self.prefill: dict[str, _Worker] = {}
        self.decode: dict[str, _Worker] = {}
        self.payloads: dict[str, object] = {}
        self.summaries: dict[str, RequestSummary] = {}
        self.placement: dict[str, tuple[str, str]] = {}  # request id -> (prefill id, decode id)
        self.attempts: dict[str, int] = {}
        self.online_streak = 0
        self.batches = 0
        self._batch_seq = 0
        self._queued_prompt = 0
        self._queued_max_tokens = 0
        self._reported: dict[str, int] = {}
        self._down: set[str] = set()
        self._stats_at = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._monitor = None
        self._bounds: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ set-up
    async def register_workers(
        self, prefill: dict[str, tuple[Any, int]], decode: dict[str, tuple[Any, int]]
    ) -> None:
        """Worker id -> (actor handle, KV blocks in its cache)."""
        self.prefill = {w: _Worker(w, h, n) for w, (h, n) in prefill.items()}
        self.decode = {w: _Worker(w, h, n) for w, (h, n) in decode.items()}
        if self.config.monitor_name is not None and self._monitor is None:
            with contextlib.suppress(ValueError):
                self._monitor = ray.get_actor(self.config.monitor_name)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    # ------------------------------------------------------------------ requests
    async def submit(self, summary: RequestSummary, payload: object) -> None:
        rid = summary.request_id
        if rid in self.summaries:
            raise ValueError(f"request_id {rid!r} is already in the cluster")
        self.summaries[rid] = summary
        self.payloads[rid] = payload
        self.attempts[rid] = 0
        self._enqueue(summary)
        self._wake.set()

    async def abort(self, request_id: str) -> bool:
        """Remove the request from the queue, or abort it on the workers it was placed on (waits for both)."""
        if request_id not in self.summaries:
            return False
        placed = self.placement.get(request_id)
        self._forget(request_id)
        if placed is not None:
            pid, did = placed
            calls = []
            if pid in self.prefill and self.prefill[pid].alive:
                calls.append(self.prefill[pid].handle.abort.remote(request_id))
            if did in self.decode and self.decode[did].alive:
                calls.append(self.decode[did].handle.abort.remote(request_id))
            for ref in calls:
                with contextlib.suppress(Exception):
                    await ref
        self._wake.set()
        return True

    async def release(self, request_id: str) -> None:
        """The request has finished (the gateway saw its last output): its decode reservation is free."""
        self._forget(request_id)
        self._wake.set()

    async def batch_done(self, prefill_id: str, batch_id: int) -> None:
        """Every request of the batch has left the prefill worker (sent, finished, given back)."""
        w = self.prefill.get(prefill_id)
        if w is not None:
            for rid in w.outstanding.pop(batch_id, ()):
                w.reserved.pop(rid, None)
        self._wake.set()

    async def requeue(self, request_id: str, reason: str, refused_by: str | None = None) -> bool:
        """A prefilled request could not reach its decode worker: prefill it again (False: give up)."""
        summary = self.summaries.get(request_id)
        if summary is None:
            return False  # aborted or finished meanwhile
        placed = self.placement.pop(request_id, None)
        if placed is not None and placed[1] in self.decode:
            self.decode[placed[1]].reserved.pop(request_id, None)
        if "unreachable" in reason and refused_by is not None:
            self._mark_down(refused_by)
        self.attempts[request_id] = self.attempts.get(request_id, 0) + 1
        if self.attempts[request_id] >= self.config.max_attempts:
            logger.warning(
                "request %s failed after %d attempts: %s", request_id, self.attempts[request_id], reason
            )
            self._forget(request_id)
            return False
        logger.info("re-planning %s: %s", request_id, reason)
        if request_id not in self.queue:
            self._enqueue(summary)
        self._wake.set()
        return True

    async def mark_down(self, worker_id: str) -> None:
        self._mark_down(worker_id)
        self._wake.set()

    async def worker_down(self, worker_id: str) -> list[str]:
        """A worker died: mark it down and give up the requests that can no longer finish; returns their ids.

        Those are the requests placed on a dead decode worker (their KV died with it), those in the batches of a
        dead prefill worker (aborted on their decode worker in case their KV got there), and, once no decode or
        no prefill worker is left alive, every request still in the cluster, which would otherwise wait for
        ever. The caller (a gateway) ends their streams with an error; the ids are forgotten here, so a
        prefill worker that later gives one of them back is told not to retry.
        """
        self._mark_down(worker_id)
        lost = [rid for rid, (_, did) in self.placement.items() if did == worker_id]
        dead_prefill = self.prefill.get(worker_id)
        if dead_prefill is not None:
            # Its batches in flight may or may not have reached their decode worker: end them, and abort them
            # there too, so no decode worker keeps running (and holding blocks for) a request nobody awaits.
            stranded = [
                rid for rids in dead_prefill.outstanding.values() for rid in rids if rid in self.summaries
            ]
            dead_prefill.outstanding.clear()
            dead_prefill.reserved.clear()
            for rid in stranded:
                placed = self.placement.get(rid)
                if placed is not None and placed[1] in self.decode and self.decode[placed[1]].alive:
                    with contextlib.suppress(Exception):
                        await self.decode[placed[1]].handle.abort.remote(rid)
            lost += [rid for rid in stranded if rid not in lost]
        pools = (self.prefill, self.decode)
        if any(pool and not any(w.alive for w in pool.values()) for pool in pools):
            lost = list(self.summaries)
        for rid in lost:
            self._forget(rid)
        self._wake.set()
        return lost

    async def state(self) -> dict:
        return {
            "queued": len(self.queue),
            "buckets": self.queue.bounds(),
            "bucket_sizes": self.queue.sizes(),
            "batches": self.batches,
            "in_cluster": len(self.summaries),
            "prefill": {
                w.worker_id: {
                    "reserved": sum(w.reserved.values()),
                    "outstanding": len(w.outstanding),
                    "alive": w.alive,
                }
                for w in self.prefill.values()
            },
            "decode": {
                w.worker_id: {
                    "reserved": sum(w.reserved.values()),
                    "requests": len(w.reserved),
                    "alive": w.alive,
                }
                for w in self.decode.values()
            },
        }

    # ------------------------------------------------------------------ internals
    def _enqueue(self, summary: RequestSummary) -> None:
        if self.fcfs:
            # One class and one priority in the queue, so batches follow arrival alone; the stored summary
            # keeps the request's own class for everything else.
            summary = dataclasses.replace(summary, priority_class=PriorityClass.ONLINE, priority=0)
        self.queue.add(summary)
        self._queued_prompt += summary.prompt_len
        self._queued_max_tokens += summary.max_tokens

    def _dequeue(self, request_id: str) -> None:
        s = self.queue.remove(request_id)
        self._queued_prompt -= s.prompt_len
        self._queued_max_tokens -= s.max_tokens

    def _forget(self, request_id: str) -> None:
        if request_id in self.queue:
            self._dequeue(request_id)
        self.summaries.pop(request_id, None)
        self.payloads.pop(request_id, None)
        self.attempts.pop(request_id, None)
        placed = self.placement.pop(request_id, None)
        if placed is not None and placed[1] in self.decode:
            self.decode[placed[1]].reserved.pop(request_id, None)
        # The prefill reservation stays until batch_done: the blocks are in use there until then.

    def _mark_down(self, worker_id: str) -> None:
        for pool in (self.prefill, self.decode):
            w = pool.get(worker_id)
            if w is not None and w.alive:
                logger.warning("worker %s is down; placing its work elsewhere", worker_id)
                w.alive = False

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.plan_interval_s)
            self._wake.clear()
            try:
                await self._refresh_stats()
                self._plan_all()
            except Exception:  # the planner must survive a bad figure or a dead worker
                logger.exception("controller planning failed")

    async def _refresh_stats(self) -> None:
        now = time.monotonic()
        if self._monitor is None or now - self._stats_at < self.config.stats_refresh_s:
            return
        self._stats_at = now
        try:
            summary = await self._monitor.summary.remote()
        except Exception as e:
            logger.warning("monitor unreachable: %s", e)
            return
        self._reported = dict(summary.get("free_kv_blocks", {}))
        # A worker that reported once and then went silent is down; one not yet seen is starting.
        self._down = {wid for wid, row in summary.get("workers", {}).items() if not row.get("up", True)}

    def _usable(self, w: _Worker) -> bool:
        return w.alive and w.worker_id not in self._down

    def _plan_all(self) -> None:
        while len(self.queue):
            prefill = [
                WorkerStats(w.worker_id, w.free_blocks(self._reported.get(w.worker_id)), len(w.outstanding))
                for w in self.prefill.values()
                if self._usable(w) and len(w.outstanding) < self.config.max_batches_per_prefill_worker
            ]
            decode = [
                WorkerStats(w.worker_id, w.free_blocks(self._reported.get(w.worker_id)), len(w.reserved))
                for w in self.decode.values()
                if self._usable(w)
            ]
            if not prefill or not decode:
                return
            p, d = choose_workers(prefill, decode)
            budget = MemoryBudget.for_workers(
                p, d, self.config.block_size, self.config.max_num_batched_tokens, reserve_output=True
            )
            n = len(self.queue)
            n_max = budget.capacity(
                self._queued_prompt / n,
                self._queued_max_tokens / n,
                max(1, self.shapes.max_prompt_batch_size),
            )
            if not self.fcfs:  # FCFS keeps the single bucket the queue starts with
                self.queue.adjust(n_max)
            self._publish_buckets()
            plan = plan_batch(
                self.queue, self.shapes, budget, self.config.policy, time.time(), self.online_streak
            )
            if plan is None:
                return  # the most urgent request does not fit yet: wait for blocks to come back
            self._dispatch(plan, self.prefill[p.worker_id], self.decode[d.worker_id])

    def _dispatch(self, plan: BatchPlan, p: _Worker, d: _Worker) -> None:
        self._batch_seq += 1
        batch_id = self._batch_seq
        items = []
        for rid in plan.request_ids:
            self._dequeue(rid)
            s = self.summaries[rid]
            p.reserved[rid] = blocks_for(s.prompt_len, self.config.block_size)
            d.reserved[rid] = blocks_for(
                min(s.prompt_len + s.max_tokens, self.config.max_model_len), self.config.block_size
            )
            self.placement[rid] = (p.worker_id, d.worker_id)
            items.append((self.payloads[rid], d.worker_id))
        p.outstanding[batch_id] = plan.request_ids
        self.online_streak = 0 if plan.priority_class.value == "offline" else self.online_streak + 1
        self.batches += 1
        p.handle.enqueue.remote(batch_id, items)

    def _publish_buckets(self) -> None:
        bounds = self.queue.bounds()
        if self._monitor is None or bounds == self._bounds:
            return
        self._bounds = bounds
        edges = [b[0] for b in bounds] + [bounds[-1][1]]
        with contextlib.suppress(Exception):
            self._monitor.set_buckets.remote(edges, self.queue.sizes())
