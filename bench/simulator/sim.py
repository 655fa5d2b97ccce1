"""Discrete-event simulation of the cluster, driven by the controller's own policy code.

Disaggregated mode drives the controller's own planning core, :class:`bucket_manager.dispatcher.Dispatcher`,
configured as the served controller configures it (:meth:`SimConfig.dispatcher_config`): requests queue in
request buckets (Algorithm 1), batches and workers are chosen by the dispatcher's plan, and its block
reservations (prompt blocks on the prefill worker until the batch's KV has left, ``prompt + max_tokens`` on the
decode worker until the request finishes) bound every batch. The simulator tells it what the workers would:
``batch_done`` when a batch's KV has left, ``forget`` when a request finishes. A prefill worker holds at most
``max_batches_per_prefill_worker`` batches and runs them FCFS; the first token is streamed when the batch ends; each request's KV then crosses to its decode worker
(one transfer at a time per prefill worker: they share its link); the decode worker admits it at its next step
and runs continuous-batching steps over every running request, each step padded to a warmed decode shape.

Colocated mode follows the colocated worker: the gateway sends each request to the worker with the fewest
requests in flight, and each worker runs the engine's step policy (:func:`engine.scheduler.plan_step`):
prefill first when waiting requests fit, FCFS with same-shape companions, else one decode step.

Time is simulated, costs come from a :class:`CostModel`; results use the benchmark client's own definitions
(:class:`bench.metrics.BenchResult`), so simulated and measured attainment and goodput mean the same thing.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

from bench.metrics import rate_at_target
from bench.simulator.host import SharedCpu
from bench.simulator.sim_types import (
    MODES,
    ColocatedState,
    DecodeState,
    PrefillState,
    SimConfig,
    SimRequest,
    SimResult,
)
from bench.workloads import sample_arrivals, sample_lengths
from bucket_manager.batch_plan import BatchPlan
from bucket_manager.dispatcher import Dispatcher
from bucket_manager.request_buckets import RequestBuckets
from engine.scheduler import RunningSeq, StepLimits, WaitingSeq, plan_step

__all__ = ["MODES", "SimConfig", "SimRequest", "SimResult", "Simulator", "max_rate_at", "simulate", "sweep"]


class Simulator:
    """One run: ``Simulator(config).run(lengths, arrivals)``."""

    def __init__(self, config: SimConfig) -> None:
        self.config = c = config
        cost = c.cost
        self.cost = cost
        self.dispatcher = Dispatcher(c.dispatcher_config())
        self.shape_config = self.dispatcher.config.shape_config
        self.shapes = self.dispatcher.shapes
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self.requests: dict[str, SimRequest] = {}
        self.stats: dict[str, Any] = {
            "prefill_batches": 0,
            "decode_steps": 0,
            "max_request_buckets": 1,
            "bucket_splits": 0,
            "padded_prompt_tokens": 0,
            "real_prompt_tokens": 0,
            "preemptions": 0,
            # seconds of calibrated engine time (before any host CPU factor), per role
            "prefill_engine_s": 0.0,
            "decode_engine_s": 0.0,
        }
        # Host contention, when modelled: the shared cores and the figures that load them.
        self._contention = (
            (SharedCpu(c.host.cores, lambda: self.now, self._at), c.host) if c.host is not None else None
        )
        d = self.dispatcher
        d.set_workers(
            {f"prefill-{i}": cost.num_blocks for i in range(c.prefill_workers)},
            {f"decode-{i}": cost.num_blocks for i in range(c.decode_workers)},
        )
        self.prefill = [PrefillState(wid, ledger) for wid, ledger in d.prefill.items()]
        self.decode = [DecodeState(wid, ledger) for wid, ledger in d.decode.items()]
        self.colocated = [
            ColocatedState(f"colocated-{i}", cost.num_blocks, cost.num_blocks)
            for i in range(c.colocated_workers)
        ]
        self._decode_by_id = {d.wid: d for d in self.decode}
        self._prefill_by_id = {p.wid: p for p in self.prefill}
        self.limits = StepLimits(cost.max_num_seqs, cost.max_num_prefill_seqs, cost.max_num_batched_tokens)

    # ------------------------------------------------------------------ event loop
    def _at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    @property
    def queue(self) -> RequestBuckets:
        """The controller's queue of requests waiting for prefill."""
        return self.dispatcher.queue

    def run(self, lengths: list[tuple[int, int]], arrivals: list[float]) -> list[SimRequest]:
        return self.run_requests(
            [
                SimRequest(f"r{i}", inp, out, t)
                for i, ((inp, out), t) in enumerate(zip(lengths, arrivals, strict=True))
            ]
        )

    def run_requests(self, requests: list[SimRequest]) -> list[SimRequest]:
        """Run a trace: each request arrives at the gateway at its ``arrival``."""
        for r in requests:
            self.requests[r.rid] = r
            if self._contention is None:
                # The request reaches the controller after the gateway's hop; its clock started at arrival.
                self._at(r.arrival + self.cost.request_overhead_s, self._arrive, r)
            else:
                self._at(r.arrival, self._gateway, r)
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            self.now = t
            fn(*args)
        return list(self.requests.values())

    def _gateway(self, r: SimRequest) -> None:
        """With host contention: the gateway's CPU work on the request, then its fixed hop."""
        assert self._contention is not None
        cpu, host = self._contention
        cpu.host(host.host_request_cpu_s, self._at_hop, r)

    def _at_hop(self, r: SimRequest) -> None:
        self._at(self.now + self.cost.request_overhead_s, self._arrive, r)

    def _work(self, wid: str, role: str, engine_s: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``engine_s`` of calibrated engine time on worker ``wid``: directly, or as CPU work on the shared
        host."""
        self.stats[f"{role}_engine_s"] += engine_s
        if self._contention is None:
            self._at(self.now + engine_s, fn, *args)
            return
        cpu, host = self._contention
        factor = host.prefill_cpu_factor if role == "prefill" else host.decode_cpu_factor
        cpu.run(wid, engine_s * factor, fn, *args)

    def _emit(self, tokens: int, first: list[SimRequest], finished: list[SimRequest]) -> None:
        """Tokens leave a worker: the client sees them once the host has streamed them (at once without host
        contention), plus the fixed per-token latency."""
        if self._contention is None:
            self._stamp(first, finished)
        else:
            cpu, host = self._contention
            cpu.host(tokens * host.host_token_cpu_s, self._stamp, first, finished)

    def _stamp(self, first: list[SimRequest], finished: list[SimRequest]) -> None:
        t = self.now + self.cost.token_overhead_s
        for r in first:
            r.first_token = t
        for r in finished:
            r.finish = t

    def _arrive(self, r: SimRequest) -> None:
        if self.config.mode == "colocated":
            w = min(self.colocated, key=lambda w: (w.in_flight, w.wid))
            w.in_flight += 1
            w.waiting.append(r)
            self._colocated_kick(w)
            return
        self.dispatcher.submit(r.summary())
        self._plan_all()

    # ------------------------------------------------------------------ controller (disaggregated)
    def _plan_all(self) -> None:
        """The controller's planning round: every batch the dispatcher plans goes to its prefill worker."""
        d = self.dispatcher
        for batch in d.plan(self.now):
            if batch.lent:
                # Elastic prefill: the decode worker runs the prompts as its next step, then decodes them.
                dec = self._decode_by_id[batch.decode_id]
                dec.lent.append((batch.batch_id, batch.plan))
                self._decode_kick(dec)
                continue
            p = self._prefill_by_id[batch.prefill_id]
            p.unsent[batch.batch_id] = set(batch.request_ids)
            p.queue.append((batch.batch_id, batch.plan, batch.decode_id))
            self._prefill_kick(p)
        self.stats["bucket_splits"] = d.bucket_splits
        self.stats["max_request_buckets"] = d.max_request_buckets

    # ------------------------------------------------------------------ prefill worker
    def _prefill_shape(self, plan: BatchPlan) -> tuple[int, int]:
        if plan.shape is not None:
            return plan.shape[0], plan.shape[1]
        return len(plan.request_ids), max(self.requests[r].prompt_len for r in plan.request_ids)

    def _prefill_work(self, plan: BatchPlan) -> float:
        """Engine seconds of a prompt batch (at its warmed shape), counted in the stats."""
        b, q = self._prefill_shape(plan)
        self.stats["prefill_batches"] += 1
        self.stats["real_prompt_tokens"] += plan.real_tokens
        self.stats["padded_prompt_tokens"] += b * q - plan.real_tokens
        return self.cost.prefill_s(b, q)

    def _first_tokens(self, plan: BatchPlan) -> list[SimRequest]:
        """A prompt batch's first tokens go out; the requests done at their first token end. Returns the others."""
        firsts, finished, rest = [], [], []
        for rid in plan.request_ids:
            r = self.requests[rid]
            firsts.append(r)
            r.first_sent = True
            r.generated = 1
            if r.output_len <= 1:
                r.done = True
                finished.append(r)
                self._release(r)
            else:
                rest.append(r)
        self._emit(len(firsts), firsts, finished)
        return rest

    def _prefill_kick(self, p: PrefillState) -> None:
        if p.busy or not p.queue:
            return
        batch_id, plan, did = p.queue.popleft()
        p.busy = True
        work = self._prefill_work(plan)
        self._work(p.wid, "prefill", work, self._prefill_done, p, batch_id, plan, did, self.now)

    def _prefill_done(
        self, p: PrefillState, batch_id: int, plan: BatchPlan, did: str, started: float
    ) -> None:
        p.busy = False
        p.forward_s[batch_id] = self.now - started  # what the worker reports with batch_done
        sends = self._first_tokens(plan)
        # Done at its first token: nothing to send, so it does not hold the batch back.
        p.unsent[batch_id] = {r.rid for r in sends} & p.unsent[batch_id]
        # The senders move each request's KV one after the other over the worker's link, overlapping the next
        # batch's compute.
        t = max(self.now, p.link_free_at)
        for r in sends:
            t += self.cost.transfer_s(r.prompt_len)
            self._at(t, self._transfer_done, p, batch_id, r, did)
        p.link_free_at = t
        if not sends:
            self._batch_left(p, batch_id)
        self._prefill_kick(p)
        self._plan_all()

    def _transfer_done(self, p: PrefillState, batch_id: int, r: SimRequest, did: str) -> None:
        left = p.unsent[batch_id]
        left.discard(r.rid)
        d = self._decode_by_id[did]
        d.arrived.append(r)
        if not left:
            self._batch_left(p, batch_id)
        self._decode_kick(d)
        self._plan_all()

    def _batch_left(self, p: PrefillState, batch_id: int) -> None:
        """``batch_done``: every request of the batch has left, its prompt reservations end."""
        p.unsent.pop(batch_id, None)
        self.dispatcher.batch_done(p.wid, batch_id, p.forward_s.pop(batch_id, None))

    def _release(self, r: SimRequest) -> None:
        """The request has finished: the gateway releases it, its decode reservation ends."""
        self.dispatcher.forget(r.rid)

    # ------------------------------------------------------------------ decode worker
    def _decode_kick(self, d: DecodeState) -> None:
        if d.busy:
            return
        if d.lent:
            # A lent prompt batch takes the worker's next step (its decodes wait one prompt step: the guard bounds it).
            batch_id, plan = d.lent.popleft()
            d.busy = True
            self._work(d.wid, "prefill", self._prefill_work(plan), self._lent_done, d, batch_id, plan)
            return
        d.running.extend(d.arrived)
        d.arrived.clear()
        if not d.running:
            return
        bs = self.cost.block_size
        # Continuous batching up to max_num_seqs; the reservations make sure the blocks are there.
        batch = d.running[: self.cost.max_num_seqs]
        blocks = sum(-(-r.num_tokens // bs) for r in batch)
        shape = self.shapes.find_decode(len(batch), blocks)
        b, n = (shape[0], shape[2]) if shape is not None else (len(batch), blocks)
        d.busy = True
        self.stats["decode_steps"] += 1
        self._work(d.wid, "decode", self.cost.decode_s(b, n), self._decode_done, d, batch)

    def _lent_done(self, d: DecodeState, batch_id: int, plan: BatchPlan) -> None:
        """A lent batch's prompts are prefilled on the decode worker: first tokens out, the rest decode there."""
        d.busy = False
        d.arrived.extend(self._first_tokens(plan))
        self.dispatcher.batch_done(d.wid, batch_id)
        self._decode_kick(d)
        self._plan_all()

    def _decode_done(self, d: DecodeState, batch: list[SimRequest]) -> None:
        d.busy = False
        ended = []
        for r in batch:
            r.generated += 1
            if r.generated >= r.output_len or r.num_tokens >= self.cost.max_model_len:
                r.done = True
                ended.append(r)
        self._emit(len(batch), [], ended)
        finished = bool(ended)
        if finished:
            keep = []
            for r in d.running:
                if not r.done:
                    keep.append(r)
                else:
                    self._release(r)
            d.running = keep
        self._decode_kick(d)
        if finished:
            self._plan_all()

    # ------------------------------------------------------------------ colocated worker
    def _query_bucket(self, n: int) -> int:
        found = self.shapes.find_prompt(1, n, 0)
        return found[1] if found else n

    def _colocated_candidates(self, w: ColocatedState) -> list[SimRequest]:
        """The engine's prefill candidates: the FCFS head, then waiting requests padding to the head's query
        bucket, cut to a batch size that is itself warmed (so no row is padding)."""
        if not w.waiting:
            return []
        head = w.waiting[0]
        q = self._query_bucket(head.num_tokens - head.computed)
        cands = [head] + [
            r
            for r in itertools.islice(w.waiting, 1, None)
            if self._query_bucket(r.num_tokens - r.computed) == q
        ]
        n = min(len(cands), self.cost.max_num_prefill_seqs)
        while n > 1:
            shape = self.shapes.find_prompt(n, q, 0)
            if shape is not None and shape[0] == n:
                break
            n -= 1
        return cands[:n]

    def _colocated_kick(self, w: ColocatedState) -> None:
        if w.busy:
            return
        bs = self.cost.block_size
        cands = self._colocated_candidates(w)
        waiting = [
            WaitingSeq(r.rid, r.num_tokens - r.computed, -(-r.num_tokens // bs) - r.blocks) for r in cands
        ]
        running = [RunningSeq(r.rid, max(0, -(-r.num_tokens // bs) - r.blocks), r.blocks) for r in w.running]
        step = plan_step(waiting, running, w.free_blocks, self.limits)
        if step.kind == "idle":
            return
        w.busy = True
        by_id = {r.rid: r for r in (*cands, *w.running)}
        if step.kind == "prefill":
            reqs = [by_id[i] for i in step.request_ids]
            for r in reqs:
                w.waiting.remove(r)
                need = -(-r.num_tokens // bs) - r.blocks
                r.blocks += need
                w.free_blocks -= need
            q = max(r.num_tokens - r.computed for r in reqs)
            shape = self.shapes.find_prompt(len(reqs), q, 0)
            b, qq = (shape[0], shape[1]) if shape is not None else (len(reqs), q)
            self.stats["prefill_batches"] += 1
            self._work(w.wid, "prefill", self.cost.prefill_s(b, qq), self._colocated_prefill_done, w, reqs)
            return
        for rid in step.preempt_ids:
            r = by_id[rid]
            w.running.remove(r)
            w.free_blocks += r.blocks
            r.blocks = 0
            r.computed = 0  # recomputed later from prompt + generated tokens, as the engine does
            w.waiting.appendleft(r)
            self.stats["preemptions"] += 1
        batch = [by_id[i] for i in step.request_ids]
        for r in batch:
            need = -(-r.num_tokens // bs) - r.blocks
            r.blocks += need
            w.free_blocks -= need
        blocks = sum(r.blocks for r in batch)
        shape = self.shapes.find_decode(len(batch), blocks)
        b, n = (shape[0], shape[2]) if shape is not None else (len(batch), blocks)
        self.stats["decode_steps"] += 1
        self._work(w.wid, "decode", self.cost.decode_s(b, n), self._colocated_decode_done, w, batch)

    def _colocated_prefill_done(self, w: ColocatedState, reqs: list[SimRequest]) -> None:
        w.busy = False
        firsts, ended = [], []
        for r in reqs:
            r.computed = r.num_tokens
            r.generated += 1
            if not r.first_sent:
                r.first_sent = True
                firsts.append(r)
            if self._colocated_after_token(w, r, prefilled=True):
                ended.append(r)
        self._emit(len(reqs), firsts, ended)
        self._colocated_kick(w)

    def _colocated_decode_done(self, w: ColocatedState, batch: list[SimRequest]) -> None:
        w.busy = False
        ended = []
        for r in batch:
            r.computed = r.num_tokens
            r.generated += 1
            if self._colocated_after_token(w, r, prefilled=False):
                ended.append(r)
        self._emit(len(batch), [], ended)
        self._colocated_kick(w)

    def _colocated_after_token(self, w: ColocatedState, r: SimRequest, prefilled: bool) -> bool:
        """True when ``r`` ended with this token."""
        if r.generated >= r.output_len or r.num_tokens >= self.cost.max_model_len:
            r.done = True
            if r in w.running:
                w.running.remove(r)
            w.free_blocks += r.blocks
            r.blocks = 0
            w.in_flight -= 1
            return True
        if prefilled:
            w.running.append(r)
        return False


# ---------------------------------------------------------------------------- runs and sweeps


def simulate(
    config: SimConfig,
    workload: str,
    rate: float,
    num_requests: int,
    seed: int = 0,
    burstiness: float = 1.0,
    max_output_len: int = 1024,
) -> SimResult:
    """Sample a workload exactly as ``bench serve`` does (same seed, same lengths, same arrivals) and run it."""
    lengths = sample_lengths(
        workload, num_requests, seed, max_model_len=config.cost.max_model_len, max_output_len=max_output_len
    )
    arrivals = sample_arrivals(num_requests, rate, seed, burstiness)
    sim = Simulator(config)
    done = sim.run(lengths, arrivals)
    return SimResult(done, config, rate, dict(sim.stats))


def sweep(
    config: SimConfig, workload: str, rates: list[float], num_requests: int, seed: int = 0, **kw: Any
) -> list[dict[str, Any]]:
    return [simulate(config, workload, r, num_requests, seed, **kw).summary() for r in rates]


def max_rate_at(rows: list[dict[str, Any]], target: float = 0.8) -> float | None:
    """The highest rate with attainment >= ``target`` by ``bench sweep``'s definition (:func:`rate_at_target`:
    the highest swept rate meeting it, interpolated towards the next swept rate); None when no rate meets it."""
    found = rate_at_target([(float(r["request_rate"]), r["slo_attainment"]) for r in rows], target)
    return found.rate if found.kind in ("interpolated", "at_least") else None
