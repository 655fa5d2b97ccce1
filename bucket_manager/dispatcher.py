"""The controller's planning core: the queue of requests waiting for prefill, the workers' block ledgers, and the
loop that turns both into dispatched batches. Pure: no Ray, no I/O, no clock (the caller passes ``now``).

The served controller (:mod:`bucket_manager.controller`) wraps it in a Ray actor; the capacity simulator drives
the same object on simulated time, so both plan with one piece of code.

Requests queue in :class:`RequestBuckets` (Algorithm 1); each planning round re-runs ``adjust`` with ``N_max``
from :meth:`MemoryBudget.capacity`, picks the prefill worker (shortest queue) and the decode worker (most free KV
blocks) with :func:`choose_workers`, and forms a batch with :func:`plan_batch`. A dispatched request reserves its
prompt's blocks on its prefill worker until the batch's KV has left (:meth:`Dispatcher.batch_done`) and
``prompt + max_tokens`` blocks on its decode worker until it finishes (:meth:`Dispatcher.forget`), so the budget
never counts a block twice even when the monitor's figures lag a step behind.

``fcfs`` scheduling is one bucket served in arrival order whatever the class or priority (the DistServe-like
baseline): the queue is keyed by arrival, every queued request is online with priority 0, and ``adjust`` never
runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bucket_manager.batch_plan import BatchPlan, first_request, plan_batch
from bucket_manager.lending import (
    LendingPolicy,
    batch_token_budget,
    lend_instead,
    pause_decode_for,
    pause_fits_tpot,
    widened_s,
    withdraw_to_lend,
)
from bucket_manager.memory_budget import MemoryBudget, WorkerLoad, blocks_for, choose_workers
from bucket_manager.prefill_pace import PrefillPace
from bucket_manager.priority import PriorityPolicy
from bucket_manager.request import PriorityClass, RequestSummary
from bucket_manager.request_buckets import RequestBuckets
from bucket_manager.shape_buckets import ShapeBucketConfig, ShapeBuckets
from bucket_manager.worker_ledger import WorkerLedger

# ``buckets``: adaptive request buckets and the priority policy (the product). ``fcfs``: one bucket, served in
# arrival order whatever the class or priority (the DistServe-like baseline the benchmarks compare against).
SCHEDULING = ("buckets", "fcfs")
# Batches whose forward time may still be reported (far more than ever run at once; the oldest go first).
MAX_TIMED_BATCHES = 1024


def _arrival_order(request: RequestSummary) -> tuple[float, ...]:
    return (request.arrival,)


def check_planning_config(config: Any) -> None:
    """Validate the planning fields of ``config`` (a :class:`DispatcherConfig` or the controller's config);
    messages name the config's own type."""
    owner = type(config).__name__
    if config.scheduling not in SCHEDULING:
        raise ValueError(f"{owner}.scheduling must be one of {SCHEDULING}, got {config.scheduling!r}")
    for name in ("block_size", "max_model_len", "max_num_batched_tokens", "max_batches_per_prefill_worker"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}.{name} must be an int >= 1, got {value!r}")
    if not isinstance(config.max_attempts, int) or config.max_attempts < 1:
        raise ValueError(f"{owner}.max_attempts must be an int >= 1, got {config.max_attempts!r}")
    if not 0.0 <= config.full_hold_s < float("inf"):
        raise ValueError(f"{owner}.full_hold_s must be a number >= 0, got {config.full_hold_s!r}")
    if not 0.0 <= config.theta < 1.0:
        raise ValueError(f"{owner}.theta must be in [0, 1), got {config.theta!r}")
    if not isinstance(config.shape_config, ShapeBucketConfig):
        raise ValueError(f"{owner}.shape_config must be a ShapeBucketConfig")
    for pair in config.core_neighbours:
        ok = (
            isinstance(pair, tuple)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and isinstance(pair[1], tuple)
        )
        if not ok or not all(isinstance(d, str) for d in pair[1]):
            raise ValueError(
                f"{owner}.core_neighbours must be (prefill worker id, (decode worker ids)) pairs, got {pair!r}"
            )


@dataclass(frozen=True)
class DispatcherConfig:
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    shape_config: ShapeBucketConfig
    policy: PriorityPolicy = field(default_factory=PriorityPolicy)
    theta: float = 0.5
    # Batches a prefill worker may hold (one running, one queued): the rest wait here, where priorities apply.
    max_batches_per_prefill_worker: int = 2
    # Prefill attempts of one request (a decode worker died, a transfer failed) before it fails.
    max_attempts: int = 4
    # A decode worker that refused a request as full gets no new request for this long: its cache is busier than
    # the ledger says (blocks of cancelled transfers still on their way back). A refusal as full is back-pressure,
    # not a failed attempt: the request waits in the queue, bounded by its deadline.
    full_hold_s: float = 0.1
    scheduling: str = "buckets"
    # Elastic prefill (bucket_manager/lending.py): decode workers with slack run prompt batches themselves.
    lending: LendingPolicy = field(default_factory=LendingPolicy)
    # (prefill worker id, decode worker ids pinned beside it on its node): the decode workers whose cores its
    # batches may borrow while they are idle (LendingPolicy.share_cores). Workers named nowhere share nothing.
    core_neighbours: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        check_planning_config(self)


@dataclass(frozen=True)
class Dispatch:
    """One batch to hand to a prefill worker; ``payloads`` are the submitted payloads, in the plan's order. A lent
    batch (``prefill_id == decode_id``) goes to a decode worker that prefills it in its own steps."""

    batch_id: int
    prefill_id: str
    decode_id: str
    plan: BatchPlan
    payloads: tuple[object, ...]
    # Decode workers (idle, on the prefill worker's node) whose cores the batch runs on besides the prefill worker's.
    borrowed: tuple[str, ...] = ()

    @property
    def request_ids(self) -> tuple[str, ...]:
        return self.plan.request_ids

    @property
    def lent(self) -> bool:
        return self.prefill_id == self.decode_id


class Dispatcher:
    """``on_buckets`` is called after each planning round's ``adjust`` (the controller publishes the buckets)."""

    def __init__(
        self, config: DispatcherConfig, on_buckets: Callable[[RequestBuckets], None] | None = None
    ) -> None:
        self.config = config
        self.shapes = ShapeBuckets(config.shape_config)
        self.fcfs = config.scheduling == "fcfs"
        # FCFS batches take requests in arrival order up to the budget, whatever their lengths or lateness.
        self.policy = (
            dataclasses.replace(config.policy, short_batch_tokens=0, late_last=False)
            if self.fcfs
            else config.policy
        )
        self.queue = RequestBuckets(
            config.max_model_len,
            self.shapes.prompt_query_lens,
            config.theta,
            key=_arrival_order if self.fcfs else config.policy.key,
        )
        self.on_buckets = on_buckets
        self.prefill: dict[str, WorkerLedger] = {}
        self.decode: dict[str, WorkerLedger] = {}
        self.payloads: dict[str, object] = {}
        self.summaries: dict[str, RequestSummary] = {}
        self.placement: dict[str, tuple[str, str]] = {}  # request id -> (prefill id, decode id)
        self.attempts: dict[str, int] = {}
        # Decode worker id -> until when (the planning clock) it gets no new request: it refused one as full.
        self._full_until: dict[str, float] = {}
        self.online_streak = 0
        self.batches = 0
        self.bucket_splits = 0
        self.lent_batches = 0
        self.max_request_buckets = 1
        self._batch_seq = 0
        self._queued_prompt = 0
        self._queued_max_tokens = 0
        self._reported: dict[str, int] = {}
        self._decode_step_s: dict[str, float] = {}  # decode worker id -> its latest step, from the monitor
        # Request id -> seconds its decode worker was paused for prompts that borrowed its cores (its TPOT's share).
        self._paused_s: dict[str, float] = {}
        self._down: set[str] = set()
        self._draining: set[str] = set()
        self._neighbours = dict(config.core_neighbours)
        # Decode worker id -> (prefill worker id, batch id) of the batch running on its cores, until that batch is done.
        self._cores_lent: dict[str, tuple[str, int]] = {}
        self.core_shared_batches = 0
        self.decode_pausing_batches = 0  # of those, batches that paused a busy decode worker
        # How fast prefill workers get through prompt tokens (their reported forward times): which queued requests
        # can still meet their TTFT. Batch id -> prompt tokens of the batches on prefill workers, for those reports.
        self.pace = PrefillPace()
        # Batch id -> (prompt tokens, how much faster than on its prefill worker's own cores it was to run).
        self._batch_tokens: dict[int, tuple[int, float]] = {}
        # Batch id -> when it was dispatched (the planning clock), for the batches on prefill workers.
        self._dispatched_at: dict[int, float] = {}
        # Requests taken back from a prefill worker's queue once, or whose batch its worker kept (:meth:`withdrawals`):
        # never asked back again.
        self._withdrawn: set[str] = set()
        self.withdrawn_batches = 0

    # ------------------------------------------------------------------ workers
    def set_workers(self, prefill: Mapping[str, int], decode: Mapping[str, int]) -> None:
        """Worker id -> KV blocks in its cache; starts fresh ledgers."""
        self.prefill = {w: WorkerLedger(w, n) for w, n in prefill.items()}
        self.decode = {w: WorkerLedger(w, n) for w, n in decode.items()}

    def update_stats(
        self,
        free_blocks: Mapping[str, int],
        down: Iterable[str],
        decode_step_s: Mapping[str, float] | None = None,
    ) -> None:
        """The monitor's latest figures: free KV blocks per worker, the workers it sees as down, and each decode
        worker's latest step in seconds (when given)."""
        self._reported = dict(free_blocks)
        self._down = set(down)
        if decode_step_s is not None:
            self._decode_step_s = dict(decode_step_s)

    def mark_down(self, worker_id: str) -> bool:
        """True when the worker was alive until now."""
        newly = False
        for pool in (self.prefill, self.decode):
            w = pool.get(worker_id)
            if w is not None and w.alive:
                w.alive = False
                newly = True
        return newly

    def is_alive(self, worker_id: str) -> bool:
        w = self.prefill.get(worker_id) or self.decode.get(worker_id)
        return w is not None and w.alive

    def revive(self, worker_id: str, total_blocks: int) -> None:
        """The worker is back (restarted, its cache empty): a fresh ledger, planned for again."""
        for pool in (self.prefill, self.decode):
            if worker_id in pool:
                pool[worker_id] = WorkerLedger(worker_id, total_blocks)

    def add_worker(self, role: str, worker_id: str, total_blocks: int) -> None:
        """A worker added while the cluster runs (autoscaling): in the ledger, not yet planned for (``revive``)."""
        pool = self.prefill if role == "prefill" else self.decode
        if worker_id in self.prefill or worker_id in self.decode:
            raise ValueError(f"worker {worker_id!r} is already in the ledger")
        pool[worker_id] = WorkerLedger(worker_id, total_blocks, alive=False)

    def drain(self, worker_id: str) -> None:
        """Plan nothing more for the worker; what it holds runs to its end (then ``remove_worker``)."""
        self._draining.add(worker_id)

    def drained(self, worker_id: str) -> bool:
        """Whether a worker holds nothing: no batch (prefill), no reservation (decode)."""
        w = self.prefill.get(worker_id) or self.decode.get(worker_id)
        return w is None or (not w.outstanding and not w.reserved)

    def remove_worker(self, worker_id: str) -> None:
        for pool in (self.prefill, self.decode):
            pool.pop(worker_id, None)
        self._draining.discard(worker_id)

    def usable(self, role: str) -> list[WorkerLedger]:
        """The role's workers planned for: alive, not reported down, not draining."""
        pool = self.prefill if role == "prefill" else self.decode
        return [w for w in pool.values() if self._usable(w)]

    def role_load(self, role: str) -> tuple[int, int, float]:
        """(workers planned for, of them busy, share of their KV blocks promised) of a role, from the ledger."""
        live = self.usable(role)
        total = sum(w.total_blocks for w in live)
        used = sum(w.reserved_blocks() for w in live)
        busy = sum(1 for w in live if w.outstanding or w.reserved)
        return len(live), busy, (used / total if total else 0.0)

    def oldest_queued_arrival(self) -> float | None:
        heads = [self.queue.oldest(c) for c in PriorityClass]
        arrivals = [h.arrival for h in heads if h is not None]
        return min(arrivals) if arrivals else None

    def _usable(self, w: WorkerLedger) -> bool:
        return w.alive and w.worker_id not in self._down and w.worker_id not in self._draining

    # ------------------------------------------------------------------ requests
    def __contains__(self, request_id: object) -> bool:
        return request_id in self.summaries or request_id in self.placement

    def request_ids(self) -> list[str]:
        """Every request in the cluster: queued, placed, or adopted after a restart (known by placement only)."""
        return list(self.summaries) + [rid for rid in self.placement if rid not in self.summaries]

    def submit(self, summary: RequestSummary, payload: object = None) -> None:
        rid = summary.request_id
        if rid in self.summaries:
            raise ValueError(f"request_id {rid!r} is already in the cluster")
        self.summaries[rid] = summary
        self.payloads[rid] = payload
        self.attempts[rid] = 0
        self._enqueue(summary)

    # ------------------------------------------------------------------ rebuilding after a restart
    def adopt_batch(
        self, prefill_id: str, batch_id: int, items: Iterable[tuple[RequestSummary, object, str]]
    ) -> None:
        """A batch a prefill worker still holds, as a restarted planner learns it from that worker: each item is
        (summary, payload, decode worker id). Reserves what :meth:`_dispatch` reserved; later batch ids follow it."""
        p = self.prefill.get(prefill_id)
        if p is None:
            return
        bs = self.config.block_size
        rids = []
        for summary, payload, decode_id in items:
            rid = summary.request_id
            rids.append(rid)
            self.summaries[rid] = summary
            self.payloads[rid] = payload
            self.attempts.setdefault(rid, 0)
            p.reserved[rid] = blocks_for(summary.prompt_len, bs)
            self.placement[rid] = (prefill_id, decode_id)
            d = self.decode.get(decode_id)
            if d is not None:
                need = min(summary.prompt_len + summary.max_tokens, self.config.max_model_len)
                d.reserved[rid] = blocks_for(need, bs)
        p.outstanding[batch_id] = tuple(rids)
        self._batch_seq = max(self._batch_seq, batch_id)

    def adopt_decoding(self, decode_id: str, held: Mapping[str, int]) -> None:
        """Requests a decode worker holds (announced or running; request id -> blocks it may grow to), as a
        restarted planner learns them: their reservations stand until they end (:meth:`forget`)."""
        d = self.decode.get(decode_id)
        if d is None:
            return
        for rid, blocks in held.items():
            d.reserved[rid] = blocks
            pid = self.placement.get(rid, ("", decode_id))[0]
            self.placement[rid] = (pid, decode_id)

    def forget(self, request_id: str) -> None:
        """The request has ended (finished, aborted, given up): out of the queue, its decode reservation free."""
        if request_id in self.queue:
            self._dequeue(request_id)
        self.summaries.pop(request_id, None)
        self.payloads.pop(request_id, None)
        self.attempts.pop(request_id, None)
        self._paused_s.pop(request_id, None)
        self._withdrawn.discard(request_id)
        placed = self.placement.pop(request_id, None)
        if placed is not None and placed[1] in self.decode:
            self.decode[placed[1]].reserved.pop(request_id, None)
        # The prefill reservation stays until batch_done: the blocks are in use there until then.

    def batch_done(self, prefill_id: str, batch_id: int, forward_s: float | None = None) -> None:
        """Every request of the batch has left the prefill worker: their prompt reservations end. For a lent batch
        (a decode worker's id): its prompts are prefilled; the requests' reservations stay until they end.
        ``forward_s``: the batch's forward pass as the prefill worker timed it (feeds :attr:`pace`)."""
        timed = self._batch_tokens.pop(batch_id, None)
        self._dispatched_at.pop(batch_id, None)
        if timed is not None and forward_s is not None:
            tokens, speedup = timed
            self.pace.observe(tokens, forward_s * speedup)
        w = self.prefill.get(prefill_id)
        if w is not None:
            for rid in w.outstanding.pop(batch_id, ()):
                w.reserved.pop(rid, None)
        elif prefill_id in self.decode:
            self.decode[prefill_id].outstanding.pop(batch_id, None)

    def requeue(self, request_id: str, full_on: str | None = None, now: float = 0.0) -> bool:
        """A prefilled request could not reach its decode worker: queue it again, or give it up (False) after
        ``max_attempts``. False too when it has ended meanwhile. ``full_on``: the decode worker refused it as full
        (at ``now``, on the planning clock): that worker is held for ``full_hold_s`` and the attempt not counted."""
        summary = self.summaries.get(request_id)
        if summary is None:
            return False
        placed = self.placement.pop(request_id, None)
        if placed is not None and placed[1] in self.decode:
            self.decode[placed[1]].reserved.pop(request_id, None)
        if full_on is not None:
            self._full_until[full_on] = max(self._full_until.get(full_on, now), now + self.config.full_hold_s)
        else:
            self.attempts[request_id] = self.attempts.get(request_id, 0) + 1
        if self.attempts.get(request_id, 0) >= self.config.max_attempts:
            self.forget(request_id)
            return False
        if request_id not in self.queue:
            self._enqueue(summary)
        return True

    def stranded_by(self, worker_id: str) -> tuple[list[str], list[str]]:
        """A worker died: (requests placed on it as decode worker, requests in its batches as prefill worker).
        Its prefill ledger is emptied; nothing is forgotten yet (see :meth:`give_up`)."""
        on_decode = [rid for rid, (_, did) in self.placement.items() if did == worker_id]
        in_batches: list[str] = []
        dead_prefill = self.prefill.get(worker_id)
        if dead_prefill is not None:
            in_batches = [
                rid for rids in dead_prefill.outstanding.values() for rid in rids if rid in self.summaries
            ]
            dead_prefill.outstanding.clear()
            dead_prefill.reserved.clear()
        dead_decode = self.decode.get(worker_id)
        if dead_decode is not None:
            dead_decode.outstanding.clear()  # its lent batches: their requests are among on_decode
        return on_decode, in_batches

    def give_up(self, lost: list[str]) -> list[str]:
        """Forget the lost requests, or every request once no prefill or no decode worker is left alive (they
        would otherwise wait for ever); returns the ids forgotten."""
        pools = (self.prefill, self.decode)
        if any(pool and not any(w.alive for w in pool.values()) for pool in pools):
            lost = self.request_ids()
        for rid in lost:
            self.forget(rid)
        return lost

    # ------------------------------------------------------------------ planning
    def plan(self, now: float) -> list[Dispatch]:
        """Dispatch batches while the queue holds requests, a prefill worker has room and the most urgent
        request fits; ``now`` is on the clock of the requests' ``arrival``."""
        dispatched: list[Dispatch] = []
        # The round's share is of what is queued when it starts: each batch of the round gets the same.
        queued_at_start = self._queued_prompt
        while len(self.queue):
            prefill = [
                WorkerLoad(w.worker_id, w.free_blocks(self._reported.get(w.worker_id)), len(w.outstanding))
                for w in self.prefill.values()
                if self._usable(w) and len(w.outstanding) < self.config.max_batches_per_prefill_worker
            ]
            decode = [
                WorkerLoad(w.worker_id, w.free_blocks(self._reported.get(w.worker_id)), len(w.reserved))
                for w in self.decode.values()
                if self._usable(w) and not self._held(w.worker_id, now)
            ]
            lending = self.config.lending
            tokens = self.config.max_num_batched_tokens
            longest = head = 0
            lenders: list[WorkerLoad] = []
            if lending.enabled:
                may_run = self._may_lend()
                lenders = [
                    WorkerLoad(w.worker_id, w.free_blocks(self._reported.get(w.worker_id)), 0)
                    for w in self._free_lenders(may_run, now)
                ]
                # Every worker that may run prompts, busy or not: none takes the whole queue while another could
                # share it.
                longest = self.queue.longest_prompt()
                runners = len(self.usable("prefill")) + len(may_run)
                tokens = batch_token_budget(queued_at_start, longest, runners, tokens)
                if lenders:  # the head of the order decides whether the next batch is lent
                    first = first_request(
                        self.queue, self.policy, now, self.online_streak, self.pace.seconds_per_token
                    )
                    head = first.prompt_len if first is not None else 0
            if not decode or not (prefill or lenders):
                break
            if lend_instead([w.queue_len for w in prefill], len(lenders), head, lending.max_tokens):
                # Every prefill worker already holds a batch: a decode worker with slack prefills this one itself.
                p = d = max(lenders, key=lambda w: (w.free_blocks, w.worker_id))
                tokens = min(tokens, lending.max_tokens)
            elif prefill:
                p, d = choose_workers(prefill, decode)
            else:
                break
            budget = MemoryBudget.for_workers(p, d, self.config.block_size, tokens, reserve_output=True)
            n = len(self.queue)
            n_max = budget.capacity(
                self._queued_prompt / n,
                self._queued_max_tokens / n,
                max(1, self.shapes.max_prompt_batch_size),
            )
            if not self.fcfs:  # FCFS keeps the single bucket the queue starts with
                before = self.queue.num_buckets
                self.queue.adjust(n_max)
                self.bucket_splits += max(0, self.queue.num_buckets - before)
                self.max_request_buckets = max(self.max_request_buckets, self.queue.num_buckets)
            if self.on_buckets is not None:
                self.on_buckets(self.queue)
            plan = plan_batch(
                self.queue,
                self.shapes,
                budget,
                self.policy,
                now,
                self.online_streak,
                self.pace.seconds_per_token,
            )
            if plan is None:
                break  # the most urgent request does not fit yet: wait for blocks to come back
            # Before this batch reserves on its decode worker (which may be the idle lender).
            borrowed = (
                self._core_lenders(p, len(self.queue) - len(plan.request_ids), plan, now)
                if p is not d
                else ()
            )
            executor = self.decode[p.worker_id] if p is d else self.prefill[p.worker_id]
            dispatched.append(self._dispatch(plan, executor, self.decode[d.worker_id], borrowed, now))
        return dispatched

    def _may_lend(self) -> list[WorkerLedger]:
        """The decode workers that may run prompts: few enough requests decoding (lending on)."""
        decoding = self._decoding()
        return [w for w in self.usable("decode") if self.config.lending.can_lend(decoding[w.worker_id], 0)]

    def _free_lenders(self, may_run: list[WorkerLedger], now: float) -> list[WorkerLedger]:
        """Of ``may_run``, those that may take a lent batch now: no lent batch of their own, not held as full, their
        cores not lent to a prefill worker's batch."""
        lent_cores = self._lent_cores()
        return [
            w
            for w in may_run
            if not w.outstanding and not self._held(w.worker_id, now) and w.worker_id not in lent_cores
        ]

    def withdrawals(self, now: float) -> list[tuple[str, int]]:
        """(prefill worker id, batch id) of the batches to take back from prefill workers' queues, at most one per
        free lender: a batch queued behind the one its worker runs, whose most urgent prompt would miss its TTFT
        target waiting there and would make it on a lender starting now (``withdraw_to_lend``). The caller asks
        the worker to give it up (it may have started meanwhile) and, if it does, calls :meth:`take_back`."""
        pace = self.pace.seconds_per_token
        # Cheap checks first: this runs after every planning round.
        if not (pace and self.config.lending.enabled) or all(
            len(w.outstanding) < 2 for w in self.prefill.values()
        ):
            return []
        lenders = len(self._free_lenders(self._may_lend(), now))
        chosen: list[tuple[str, int]] = []
        for w in self.prefill.values():
            if len(chosen) >= lenders:
                break
            if not self._usable(w) or len(w.outstanding) < 2:
                continue
            # Batches in dispatch order: the first runs (or has run and is sending its KV), the rest wait.
            running, *waiting = w.outstanding
            started = self._dispatched_at.get(running)
            timed = self._batch_tokens.get(running)
            if started is None or timed is None:
                continue
            tokens, speedup = timed
            left = started + tokens * pace / speedup - now  # at the earliest it started when dispatched
            for bid in waiting:
                rids = w.outstanding[bid]
                own = self._batch_tokens.get(bid)
                if own is None or any(r in self._withdrawn or r not in self.summaries for r in rids):
                    continue
                slack = min(self.summaries[r].ttft_deadline for r in rids) - now
                if withdraw_to_lend(own[0], own[0] * pace, left, slack, self.config.lending.max_tokens):
                    chosen.append((w.worker_id, bid))
                    break
                left += own[0] * pace / own[1]
        return chosen

    def take_back(self, prefill_id: str, batch_id: int) -> list[str]:
        """The prefill worker gave up a batch it had not started (:meth:`withdrawals`): its requests' reservations
        end and they queue again, to be planned anew; returns their ids."""
        w = self.prefill.get(prefill_id)
        rids = w.outstanding.pop(batch_id, ()) if w is not None else ()
        self._batch_tokens.pop(batch_id, None)
        self._dispatched_at.pop(batch_id, None)
        back: list[str] = []
        for rid in rids:
            if w is not None:
                w.reserved.pop(rid, None)
            placed = self.placement.pop(rid, None)
            if placed is not None and placed[1] in self.decode:
                self.decode[placed[1]].reserved.pop(rid, None)
            summary = self.summaries.get(rid)
            if summary is not None and rid not in self.queue:
                self._withdrawn.add(rid)
                self._enqueue(summary)
                back.append(rid)
        self.withdrawn_batches += bool(rids)
        return back

    def keep(self, prefill_id: str, batch_id: int) -> None:
        """The prefill worker kept a batch asked back (it had started): its requests are not asked back again."""
        w = self.prefill.get(prefill_id)
        if w is not None:
            self._withdrawn.update(w.outstanding.get(batch_id, ()))

    def _lent_cores(self) -> dict[str, tuple[str, int]]:
        """Decode worker id -> (prefill worker id, batch id) running on its cores; an entry ends with its batch
        (done, given back, or its prefill worker gone)."""
        for did, (pid, bid) in list(self._cores_lent.items()):
            p = self.prefill.get(pid)
            if p is None or bid not in p.outstanding:
                del self._cores_lent[did]
        return self._cores_lent

    def _core_lenders(self, p: WorkerLoad, left_queued: int, plan: BatchPlan, now: float) -> tuple[str, ...]:
        """The decode workers whose cores the prefill worker ``p``'s next batch (``plan``) may borrow: only a batch
        that starts at once (``p`` holds none) and leaves nothing queued (a burst runs in batches side by side
        instead, one of them lent to the idle decode worker), and only decode workers of its node that run no lent
        batch: those that hold nothing, and the busy ones too when the batch needs their cores to meet its TTFT
        deadline (``LendingPolicy.pause_decode_ms``; they stop stepping for its forward pass)."""
        lending = self.config.lending
        if not (lending.enabled and lending.share_cores) or p.queue_len or left_queued:
            return ()
        lent = self._lent_cores()
        idle: list[str] = []
        every: list[str] = []
        for did in self._neighbours.get(p.worker_id, ()):
            w = self.decode.get(did)
            if w is None or not self._usable(w) or w.outstanding or did in lent:
                continue
            every.append(did)
            if not w.reserved:
                idle.append(did)
        if len(every) > len(idle):
            slack = min(self.summaries[rid].ttft_deadline for rid in plan.request_ids) - now
            alone = plan.real_tokens * self.pace.seconds_per_token
            if pause_decode_for(alone, slack, 1, len(every), lending.pause_decode_ms / 1e3):
                # Only for a batch that needs the cores: who decodes there, and whether their TPOT targets allow it.
                pause = widened_s(alone, 1, len(every))
                decoding = self._decoding_ids([did for did in every if did not in idle])
                if all(
                    pause_fits_tpot(
                        pause, [self._pause_account(rid) for rid in rids], self._decode_step_s.get(did, 0.0)
                    )
                    for did, rids in decoding.items()
                ):
                    for rids in decoding.values():
                        for rid in rids:
                            self._paused_s[rid] = self._paused_s.get(rid, 0.0) + pause
                    self.decode_pausing_batches += 1
                    return tuple(every)
        return tuple(idle)

    def _decoding_ids(self, worker_ids: list[str]) -> dict[str, list[str]]:
        """The requests each of these decode workers decodes now (see ``_decoding``)."""
        batches = [*self.prefill.values(), *self.decode.values()]
        in_prefill = {rid for w in batches for rids in w.outstanding.values() for rid in rids}
        return {
            did: [rid for rid in self.decode[did].reserved if rid not in in_prefill] for did in worker_ids
        }

    def _pause_account(self, request_id: str) -> tuple[float, float | None, int]:
        """(seconds paused so far, TPOT target in seconds or None, most output tokens) of a request decoding."""
        s = self.summaries.get(request_id)
        tpot_ms = s.tpot_slo_ms if s is not None else None
        max_tokens = s.max_tokens if s is not None else 1
        return self._paused_s.get(request_id, 0.0), None if tpot_ms is None else tpot_ms / 1e3, max_tokens

    def _held(self, worker_id: str, now: float) -> bool:
        """The decode worker refused a request as full less than ``full_hold_s`` ago."""
        until = self._full_until.get(worker_id)
        if until is None:
            return False
        if now >= until:
            del self._full_until[worker_id]
            return False
        return True

    def _decoding(self) -> dict[str, int]:
        """Requests each decode worker decodes now: those it holds whose prompts are no longer in a prompt batch
        (requests still being prefilled, elsewhere or in its own lent batch, join its steps later)."""
        return {did: len(rids) for did, rids in self._decoding_ids(list(self.decode)).items()}

    def _dispatch(
        self,
        plan: BatchPlan,
        p: WorkerLedger,
        d: WorkerLedger,
        borrowed: tuple[str, ...] = (),
        now: float = 0.0,
    ) -> Dispatch:
        self._batch_seq += 1
        bs = self.config.block_size
        for rid in plan.request_ids:
            self._dequeue(rid)
            s = self.summaries[rid]
            p.reserved[rid] = blocks_for(s.prompt_len, bs)
            d.reserved[rid] = blocks_for(min(s.prompt_len + s.max_tokens, self.config.max_model_len), bs)
            self.placement[rid] = (p.worker_id, d.worker_id)
        p.outstanding[self._batch_seq] = plan.request_ids
        # A lent batch's prompt steps are mixed with decodes: no measure of a prefill worker's pace.
        if p is not d:
            # Paced on the prefill worker's own cores: a batch on borrowed cores too counts as its estimate alone.
            speedup = 1.0 / widened_s(1.0, 1, len(borrowed))
            self._batch_tokens[self._batch_seq] = (plan.real_tokens, speedup)
            self._dispatched_at[self._batch_seq] = now
            if len(self._batch_tokens) > MAX_TIMED_BATCHES:  # batches of a worker that died never report
                del self._batch_tokens[next(iter(self._batch_tokens))]
            if len(self._dispatched_at) > MAX_TIMED_BATCHES:
                del self._dispatched_at[next(iter(self._dispatched_at))]
        self.online_streak = 0 if plan.priority_class.value == "offline" else self.online_streak + 1
        self.batches += 1
        self.lent_batches += p is d
        payloads = tuple(self.payloads[rid] for rid in plan.request_ids)
        for did in borrowed:
            self._cores_lent[did] = (p.worker_id, self._batch_seq)
        self.core_shared_batches += bool(borrowed)
        return Dispatch(self._batch_seq, p.worker_id, d.worker_id, plan, payloads, borrowed)

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

    # ------------------------------------------------------------------ reporting
    def state(self) -> dict:
        lent_cores = self._lent_cores()
        return {
            "queued": len(self.queue),
            "buckets": self.queue.bounds(),
            "bucket_sizes": self.queue.sizes(),
            "batches": self.batches,
            "lent_batches": self.lent_batches,
            "withdrawn_batches": self.withdrawn_batches,
            "core_shared_batches": self.core_shared_batches,
            "decode_pausing_batches": self.decode_pausing_batches,
            "prefill_s_per_token": self.pace.seconds_per_token,
            "in_cluster": len(self.request_ids()),
            "prefill": {
                w.worker_id: {
                    "reserved": w.reserved_blocks(),
                    "outstanding": len(w.outstanding),
                    "alive": w.alive,
                }
                for w in self.prefill.values()
            },
            "decode": {
                w.worker_id: {
                    "reserved": w.reserved_blocks(),
                    "requests": len(w.reserved),
                    "lent_batches": len(w.outstanding),
                    "cores_lent": w.worker_id in lent_cores,
                    "alive": w.alive,
                }
                for w in self.decode.values()
            },
        }
