"""The bucketing controller: a thin Ray actor around :class:`Dispatcher`, the pure planning core of this package.

It receives submits, releases, aborts and worker news, polls the monitor for free KV blocks and worker health,
asks the dispatcher to plan, and hands each dispatched batch to its prefill worker (``enqueue``). It speaks in
:class:`RequestSummary` and ids; the full request travels as an opaque payload it hands to the prefill worker
untouched. Workers are reached by actor handle only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import ray

from bucket_manager.autoscale import ROLES, ScalingConfig, ScalingState, idle, pressure
from bucket_manager.dispatch_socket import DispatchChannel, FrameListener, encode_frame
from bucket_manager.dispatcher import SCHEDULING, Dispatcher, DispatcherConfig, check_planning_config
from bucket_manager.lending import LendingPolicy
from bucket_manager.local_socket import this_node_id
from bucket_manager.priority import PriorityPolicy
from bucket_manager.request import RequestSummary
from bucket_manager.request_buckets import RequestBuckets
from bucket_manager.shape_buckets import ShapeBucketConfig

__all__ = ["SCHEDULING", "Controller", "ControllerConfig"]

logger = logging.getLogger(__name__)

# How long after a failed attempt a prefill worker is asked again for its dispatch socket (Ray carries its batches
# meanwhile).
CHANNEL_RETRY_S = 5.0
# Ids of aborts of unknown requests kept, to drop a submit that comes after its abort (see Controller.abort).
ABORTED_UNKNOWN_KEPT = 4096


@dataclass(frozen=True)
class ControllerConfig:
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    shape_config: ShapeBucketConfig
    monitor_name: str | None = None
    # The cluster's Ray namespace, where the monitor lives (None: the controller's job namespace).
    namespace: str | None = None
    policy: PriorityPolicy = field(default_factory=PriorityPolicy)
    theta: float = 0.5
    # Batches a prefill worker may hold (one running, one queued): the rest wait here, where priorities apply.
    max_batches_per_prefill_worker: int = 2
    # How often the monitor's figures are re-read, and the planner wakes when nothing happens.
    stats_refresh_s: float = 0.1
    plan_interval_s: float = 0.05
    # With nothing queued (and no autoscaler), both happen this often instead: a new request wakes the planner at
    # once anyway, and an idle cluster on a small host keeps its cores for the requests (ten reads of the monitor a
    # second cost the two processes about 50 ms of CPU per second on a 2-core host).
    idle_interval_s: float = 1.0
    # Figures older than this (the monitor is slow, hung or gone) are dropped: the planner then goes by its own
    # ledger of reservations alone, rather than by a worker's free blocks as they were long ago.
    stats_max_age_s: float = 2.0
    # Until the monitor's first answer (it starts alongside, under the start-up's load), no figures are not called
    # stale before this: planning goes by the ledger meanwhile either way, and start-up logs no false alarm.
    stats_first_wait_s: float = 15.0
    # Prefill attempts of one request (a decode worker died, a transfer failed) before it fails.
    max_attempts: int = 4
    # How long a decode worker that refused a request as full gets no new one (DispatcherConfig.full_hold_s).
    full_hold_s: float = 0.1
    scheduling: str = "buckets"
    # Elastic prefill: decode workers with slack run prompt batches themselves (bucket_manager/lending.py).
    lending: LendingPolicy = field(default_factory=LendingPolicy)
    # DispatcherConfig.core_neighbours; and the cores each worker is pinned to (worker id, core ids), which a
    # prefill worker borrows from an idle neighbour.
    core_neighbours: tuple[tuple[str, tuple[str, ...]], ...] = ()
    worker_cores: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # The cluster's workers as (role, Ray actor name): a restarted controller finds them by name and rebuilds its
    # ledger from what they hold (empty: it waits for register_workers, as a first start does).
    workers: tuple[tuple[str, str], ...] = ()
    # The most a restarted controller waits for one worker's answer while it rebuilds (a dead or hung one is down).
    recover_timeout_s: float = 10.0
    # Autoscaling (bucket_manager/autoscale.py): None keeps the worker counts of the start. Needs a spawner.
    scaling: ScalingConfig | None = None
    # How often the autoscaling policy is evaluated.
    scaling_interval_s: float = 0.25
    # A worker the autoscaler started that has not joined after this long is stopped and forgotten.
    scaling_start_timeout_s: float = 900.0
    # A drained worker is killed this long after it leaves the cluster's member list, so that every gateway has
    # stopped reading from it first (they re-read the list twice a second).
    retire_grace_s: float = 2.0

    def __post_init__(self) -> None:
        check_planning_config(self)
        for pair in self.worker_cores:
            ok = isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
            if (
                not ok
                or not isinstance(pair[1], tuple)
                or not all(isinstance(c, int) and c >= 0 for c in pair[1])
            ):
                raise ValueError(
                    f"ControllerConfig.worker_cores must be (worker id, (core ids)) pairs, got {pair!r}"
                )
        for role, name in self.workers:
            if role not in ("prefill", "decode") or not name:
                raise ValueError(
                    f"ControllerConfig.workers must be (prefill|decode, name) pairs, got {(role, name)!r}"
                )
        for name in (
            "stats_refresh_s",
            "plan_interval_s",
            "idle_interval_s",
            "stats_max_age_s",
            "stats_first_wait_s",
            "recover_timeout_s",
            "scaling_interval_s",
            "scaling_start_timeout_s",
            "retire_grace_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"ControllerConfig.{name} must be > 0, got {value!r}")
        if self.idle_interval_s >= self.stats_max_age_s:
            # An idle controller would otherwise call its own figures stale between two reads.
            raise ValueError(
                f"ControllerConfig.idle_interval_s must be below stats_max_age_s ({self.stats_max_age_s}), "
                f"got {self.idle_interval_s!r}"
            )

    def dispatcher_config(self) -> DispatcherConfig:
        """The planning part of this config: what the dispatcher is built from."""
        return DispatcherConfig(**{f.name: getattr(self, f.name) for f in fields(DispatcherConfig)})


def restarted_actor() -> bool:
    """Whether this process is a Ray actor that Ray has restarted (False when run in place, as the simulator and
    the tests run the controller)."""
    if not ray.is_initialized():  # asking for the runtime context would start Ray
        return False
    ctx = ray.get_runtime_context()
    if ctx.worker.mode != ray.WORKER_MODE or ctx.get_actor_id() is None:
        return False
    # It reads Ray's own deprecated actor_id, which would warn in every actor's log.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ctx.was_current_actor_reconstructed)


class Controller:
    """Run as a named async Ray actor (``ray.remote(Controller).options(name=...)``).

    ``spawner`` (autoscaling) starts and stops worker actors; the launcher, which knows how a worker is made, hands
    it over. It has ``start(role) -> worker id`` (returns at once; the worker calls ``worker_up`` once warmed),
    ``stop(worker id)`` and ``candidates() -> [(role, worker id)]``: every name a worker it started may have, so a
    restarted controller finds them too.
    """

    def __init__(self, config: ControllerConfig, spawner: Any = None) -> None:
        self.config = config
        self._spawner = spawner
        self._scaling = (
            ScalingState(config.scaling) if config.scaling is not None and spawner is not None else None
        )
        self._scaled_at = 0.0
        # Workers removed by the autoscaler: a gateway that reports one as dead lost nothing with it.
        self._retired: set[str] = set()
        self.dispatcher = Dispatcher(config.dispatcher_config(), on_buckets=self._publish_buckets)
        self._worker_cores = dict(config.worker_cores)
        self.handles: dict[str, Any] = {}  # worker id -> actor handle
        # Prefill workers on this node take their batches over a socket (bucket_manager/dispatch_socket.py): the
        # open channels, the opens under way, and when a worker whose channel failed may be asked again.
        self._channels: dict[str, DispatchChannel] = {}
        self._opening: set[str] = set()
        self._channel_retry_at: dict[str, float] = {}
        # (prefill worker id, batch id) of the batches being asked back from a prefill worker's queue to be lent.
        self._withdrawing: set[tuple[str, int]] = set()
        # The asks under way, held here: the event loop keeps only weak references to its tasks.
        self._take_backs: set[asyncio.Task] = set()
        # Gateways on this node submit over a socket of this controller (opened when the first one asks), whose
        # reader thread hands each submit to the event loop; the submits it has under way.
        self._submit_socket: FrameListener | None = None
        self._socket_submits: set[asyncio.Task] = set()
        # Ids of recent aborts of requests this controller did not hold: an abort goes by Ray and may overtake its
        # submit on the socket, which is then dropped when it comes. Bounded: an overtaken submit is milliseconds
        # behind its abort.
        self._aborted_unknown: collections.OrderedDict[str, None] = collections.OrderedDict()
        # The monitor's figures: when they were last asked for and last received, the read in flight (one at a
        # time, so a slow monitor never gets a backlog of reads), and whether they are known to be stale.
        self._stats_asked = 0.0
        self._stats_at = time.monotonic()
        self._stats_read: asyncio.Task | None = None
        self._stats_error: str | None = None
        self._stats_stale = False
        self._stats_seen = False  # whether the monitor has answered once
        self._decode_step_s: float | None = None  # the slowest decode worker's latest step, from the monitor
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._monitor = None
        self._bounds: list[tuple[int, int]] = []
        # Which life of this actor answers: a gateway that sees it change sends again what it had submitted and
        # not yet seen dispatched (the queue died with the old life).
        self.incarnation = uuid.uuid4().hex
        # Requests each dead worker took down, kept so that every gateway that asks gets the same answer.
        self._lost_by: dict[str, list[str]] = {}
        # When each restarted worker came back (wall clock): a death reported as noticed before that is its old one.
        self._up_at: dict[str, float] = {}
        # After a restart (Ray re-creates the actor from the same config), the ledger is rebuilt from the workers
        # before any call is served.
        self._restarted = bool(config.workers) and restarted_actor()
        self._recovered: asyncio.Task | None = None

    # ------------------------------------------------------------------ set-up
    async def register_workers(
        self, prefill: dict[str, tuple[Any, int]], decode: dict[str, tuple[Any, int]]
    ) -> None:
        """Worker id -> (actor handle, KV blocks in its cache)."""
        if self._restarted:
            # The launcher's call retried after a restart: the rebuild has registered them.
            await self._ready()
            return
        await self._register(prefill, decode)

    async def _register(
        self, prefill: dict[str, tuple[Any, int]], decode: dict[str, tuple[Any, int]]
    ) -> None:
        self.dispatcher.set_workers(
            {w: n for w, (_, n) in prefill.items()}, {w: n for w, (_, n) in decode.items()}
        )
        self.handles = {w: h for pool in (prefill, decode) for w, (h, _) in pool.items()}
        if self.config.monitor_name is not None and self._monitor is None:
            with contextlib.suppress(ValueError):
                self._monitor = ray.get_actor(self.config.monitor_name, namespace=self.config.namespace)
        for worker_id in prefill:
            self._close_channel(worker_id)
            self._dispatch_channel(worker_id)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _ready(self) -> None:
        """Every call waits for this: the rebuild after a restart, once (nothing to do on a first start)."""
        if not self._restarted:
            return
        if self._recovered is None:
            self._recovered = asyncio.get_running_loop().create_task(self._recover())
        await asyncio.shield(self._recovered)

    async def _recover(self) -> None:
        """Rebuild the ledger from the workers, found by name: their KV capacity, the batches each prefill worker
        holds and the requests each decode worker holds. A worker that does not answer is down. The queue is not
        rebuilt here: the gateways send again what they submitted and have not seen dispatched (``resubmit``)."""
        t0 = time.monotonic()
        timeout = self.config.recover_timeout_s

        async def find(name: str) -> tuple[Any, int] | None:
            row = await self._probe(name)
            if row is None:
                logger.warning("worker %s is down after the controller's restart", name)
            return row

        found = await asyncio.gather(*(find(name) for _, name in self.config.workers))
        pools: dict[str, dict[str, tuple[Any, int]]] = {"prefill": {}, "decode": {}}
        down = []
        for (role, name), row in zip(self.config.workers, found, strict=True):
            if row is None:
                down.append(name)
                row = (None, 1)
            pools[role][name] = row
        # Workers the autoscaler added: those alive rejoin the ledger; the others were removed or never started.
        configured = {name for _, name in self.config.workers}
        extras = [
            (r, n) for r, n in (self._spawner.candidates() if self._spawner else ()) if n not in configured
        ]
        for (role, name), row in zip(
            extras, await asyncio.gather(*(self._probe(n) for _, n in extras)), strict=True
        ):
            if row is not None:
                pools[role][name] = row
        await self._register(pools["prefill"], pools["decode"])
        for name in down:
            self.dispatcher.mark_down(name)

        async def ask(name: str, method: str) -> Any:
            try:
                return await asyncio.wait_for(getattr(self.handles[name], method).remote(), timeout)
            except Exception as e:
                logger.warning("worker %s: %s failed after the restart (%s): down", name, method, e)
                self.dispatcher.mark_down(name)
                return None

        live = [n for n in pools["prefill"] if n not in down]
        for name, batches in zip(
            live, await asyncio.gather(*(ask(n, "held_batches") for n in live)), strict=True
        ):
            for batch_id, items in batches or ():
                self.dispatcher.adopt_batch(name, batch_id, items)
        live = [n for n in pools["decode"] if n not in down]
        for name, held in zip(
            live, await asyncio.gather(*(ask(n, "held_requests") for n in live)), strict=True
        ):
            self.dispatcher.adopt_decoding(name, held or {})
        state = self.dispatcher.state()
        logger.warning(
            "controller restarted: ledger rebuilt from %d worker(s) in %.2f s (%d request(s) in the cluster, %s down)",
            len(self.config.workers),
            time.monotonic() - t0,
            state["in_cluster"],
            down or "none",
        )

    async def _probe(self, name: str) -> tuple[Any, int] | None:
        """An actor of that name, if one runs, and its KV capacity; None when there is none or it does not answer."""
        try:
            handle = ray.get_actor(name, namespace=self.config.namespace)
        except ValueError:
            return None
        try:
            info = await asyncio.wait_for(handle.info.remote(), self.config.recover_timeout_s)
        except Exception as e:
            logger.warning("worker %s did not answer the restarted controller (%s)", name, e)
            return None
        return handle, info.kv_blocks_total

    # ------------------------------------------------------------------ requests
    async def submit(self, summary: RequestSummary, payload: object) -> None:
        await self._ready()
        if summary.request_id in self.dispatcher:
            return  # sent again after a restart, or a retried call: already here
        if summary.request_id in self._aborted_unknown:
            del self._aborted_unknown[summary.request_id]
            logger.info("dropped the submit of %s: its abort came first", summary.request_id)
            return
        self.dispatcher.submit(summary, payload)
        # Planned here, not a turn of the loop later: a prompt that fits goes to its worker in this call. The
        # planning loop still wakes (stats, autoscaling, what did not fit).
        self._plan_now()
        self._wake.set()

    async def submit_channel(self) -> tuple[str, str]:
        """``(node id, path)`` of this controller's submit socket: a gateway on the same node writes its submits
        there (``bucket_manager/dispatch_socket.py``), each handled as a call of :meth:`submit` in arrival order."""
        if self._submit_socket is None:
            loop = asyncio.get_running_loop()
            self._submit_socket = FrameListener(
                "submit", lambda frame: loop.call_soon_threadsafe(self._socket_submit, frame), "controller"
            )
        node = this_node_id()
        return node, self._submit_socket.path

    def _socket_submit(self, frame: tuple[RequestSummary, object]) -> None:
        # Tasks start in the order they are made, and submit() runs to its ledger entry without a pause (unless a
        # restart's rebuild is under way, which they then wait for in the same order).
        task = asyncio.get_running_loop().create_task(self.submit(*frame))
        self._socket_submits.add(task)
        task.add_done_callback(self._socket_submit_done)

    def _socket_submit_done(self, task: asyncio.Task) -> None:
        self._socket_submits.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("a submit from the socket failed: %r", task.exception())

    async def resubmit(self, requests: list[tuple[RequestSummary, object]]) -> int:
        """A gateway's requests after this controller restarted: queued again unless a worker holds them (they
        were dispatched before the restart); returns how many were queued again."""
        await self._ready()
        queued = 0
        for summary, payload in requests:
            if summary.request_id not in self.dispatcher:
                self.dispatcher.submit(summary, payload)
                queued += 1
        if queued:
            logger.warning("%d request(s) queued again after the restart", queued)
        self._wake.set()
        return queued

    async def get_incarnation(self) -> str:
        return self.incarnation

    async def abort(self, request_id: str) -> bool:
        """Remove the request from the queue, or abort it on the workers it was placed on (waits for both). The id
        of one this controller does not hold is remembered: its submit may still be on the way over the socket, and
        is dropped when it comes (request ids are the gateway's own and never reused)."""
        await self._ready()
        d = self.dispatcher
        if request_id not in d:
            self._aborted_unknown[request_id] = None
            while len(self._aborted_unknown) > ABORTED_UNKNOWN_KEPT:
                self._aborted_unknown.popitem(last=False)
            return False
        placed = d.placement.get(request_id)
        d.forget(request_id)
        if placed is not None:
            pid, did = placed
            calls = []
            if pid in d.prefill and d.prefill[pid].alive:
                calls.append(self.handles[pid].abort.remote(request_id))
            if did in d.decode and d.decode[did].alive:
                calls.append(self.handles[did].abort.remote(request_id))
            for ref in calls:
                with contextlib.suppress(Exception):
                    await ref
        self._wake.set()
        return True

    async def release(self, request_id: str) -> None:
        """The request has finished (the gateway saw its last output): its decode reservation is free."""
        await self._ready()
        self.dispatcher.forget(request_id)
        self._wake.set()

    async def batch_done(self, prefill_id: str, batch_id: int, forward_s: float | None = None) -> None:
        """Every request of the batch has left the prefill worker (sent, finished, given back); ``forward_s``: its
        forward pass, as the worker timed it (the prefill pace that tells which requests can still meet TTFT)."""
        await self._ready()
        self.dispatcher.batch_done(prefill_id, batch_id, forward_s)
        self._wake.set()

    async def requeue(
        self, request_id: str, reason: str, full_on: str | None = None, down: str | None = None
    ) -> bool:
        """A prefilled request could not reach its decode worker: prefill it again (False: give up). ``full_on``:
        the decode worker that refused it as full (back-pressure, not a failed attempt); ``down``: the one that did
        not answer (marked down)."""
        await self._ready()
        if request_id not in self.dispatcher:
            return False  # aborted or finished meanwhile
        if down is not None:
            self._mark_down(down)
        if not self.dispatcher.requeue(request_id, full_on, time.time()):
            logger.warning(
                "request %s failed after %d attempts: %s", request_id, self.config.max_attempts, reason
            )
            return False
        logger.info("re-planning %s: %s", request_id, reason)
        self._wake.set()
        return True

    async def mark_down(self, worker_id: str) -> None:
        await self._ready()
        self._mark_down(worker_id)
        self._wake.set()

    async def worker_up(self, worker_id: str, kv_blocks: int, up_at: float) -> None:
        """A worker Ray restarted is serving again (``up_at``: its wall-clock time then), its cache empty. What it
        held died with its old life: given up here if no gateway has reported that death yet (they get the list
        when they do). Its ledger starts afresh, and the prefill workers learn the decode workers' addresses
        again (a restarted decode worker listens on a new one; a restarted prefill worker knows none)."""
        await self._ready()
        d = self.dispatcher
        if self._scaling is not None and worker_id in self._scaling.starting:
            await self._join(worker_id, kv_blocks)
            return
        if worker_id not in d.prefill and worker_id not in d.decode:
            role = (
                dict((n, r) for r, n in self._spawner.candidates()).get(worker_id) if self._scaling else None
            )
            if role is None:
                logger.warning("worker_up from %s, which is not one of this cluster's workers", worker_id)
                return
            # Started by this controller's last life (the decision died with it): it joins all the same.
            self._scaling.started(role, worker_id, time.monotonic())  # type: ignore[union-attr]
            await self._join(worker_id, kv_blocks)
            return
        if d.is_alive(worker_id):
            await self._give_up_on(worker_id)
        self._up_at[worker_id] = up_at
        try:
            handle = ray.get_actor(worker_id, namespace=self.config.namespace)
        except ValueError:
            handle = self.handles.get(worker_id)
        self.handles[worker_id] = handle
        if worker_id in self.dispatcher.prefill:
            self._close_channel(worker_id)  # the old process's socket went with it
        # The addresses first, then the ledger: nothing is planned for it before its KV can go where it should.
        await self._share_decode_peers(back=worker_id)
        d.revive(worker_id, kv_blocks)
        logger.warning(
            "worker %s is back (restarted, %d KV blocks); planning for it again", worker_id, kv_blocks
        )
        self._wake.set()

    async def _share_decode_peers(self, back: str) -> None:
        """Every live prefill worker, and ``back`` (the worker coming back), gets every live decode worker's
        current address; returns once they have it."""
        d = self.dispatcher
        timeout = self.config.recover_timeout_s
        live = [w for w in d.decode if d.is_alive(w) or w == back]
        answers = await asyncio.gather(
            *(asyncio.wait_for(self.handles[w].peer.remote(), timeout) for w in live), return_exceptions=True
        )
        peers = {
            w: peer for w, peer in zip(live, answers, strict=True) if not isinstance(peer, BaseException)
        }
        targets = [w for w in d.prefill if d.is_alive(w) or w == back]
        await asyncio.gather(
            *(asyncio.wait_for(self.handles[w].set_decode_workers.remote(peers), timeout) for w in targets),
            return_exceptions=True,
        )

    async def members(self) -> dict[str, str]:
        """The cluster's workers now, id -> role: what every gateway reads from (it follows the autoscaler's
        additions and removals). A worker still starting is not one yet."""
        await self._ready()
        d = self.dispatcher
        return {w: role for role, pool in (("prefill", d.prefill), ("decode", d.decode)) for w in pool}

    async def worker_down(self, worker_id: str, noticed_at: float | None = None) -> list[str]:
        """A worker died: mark it down and give up the requests that can no longer finish; returns their ids.

        Those are the requests placed on a dead decode worker (their KV died with it), those in the batches of a
        dead prefill worker (aborted on their decode worker in case their KV got there), and, once no decode or
        no prefill worker is left alive, every request still in the cluster, which would otherwise wait for
        ever. The caller (a gateway) ends their streams with an error; the ids are forgotten here, so a
        prefill worker that later gives one of them back is told not to retry.
        """
        await self._ready()
        if worker_id in self._retired:
            return []  # drained, then removed by the autoscaler: it held nothing
        if not self.dispatcher.is_alive(worker_id) and worker_id in self._lost_by:
            # Every gateway asks: each gets the whole list, and ends the streams among them that are its own.
            return list(self._lost_by[worker_id])
        if noticed_at is not None and noticed_at < self._up_at.get(worker_id, float("-inf")):
            # A gateway late to report a death the worker has already come back from: that life's list.
            return list(self._lost_by.get(worker_id, ()))
        return await self._give_up_on(worker_id)

    async def _give_up_on(self, worker_id: str) -> list[str]:
        d = self.dispatcher
        self._mark_down(worker_id)
        lost, stranded = d.stranded_by(worker_id)
        # The dead prefill worker's batches in flight may or may not have reached their decode worker: end them,
        # and abort them there too, so no decode worker keeps running (and holding blocks for) a request nobody
        # awaits. Where each went is read now: give_up forgets it.
        on_decode = []
        for rid in stranded:
            placed = d.placement.get(rid)
            if placed is not None and placed[1] in d.decode and d.decode[placed[1]].alive:
                on_decode.append((rid, placed[1]))
        lost += [rid for rid in stranded if rid not in lost]
        lost = d.give_up(lost)
        # Recorded before the first await: another gateway reporting the same death meanwhile gets this list (its
        # call would otherwise find the worker down, nothing stranded left, and end none of its requests).
        self._lost_by[worker_id] = lost
        self._wake.set()
        for rid, decode_id in on_decode:
            with contextlib.suppress(Exception):
                await self.handles[decode_id].abort.remote(rid)
        return lost

    async def state(self) -> dict:
        await self._ready()
        state = {**self.dispatcher.state(), "incarnation": self.incarnation}
        state["submits_by_socket"] = self._submit_socket.frames if self._submit_socket is not None else 0
        if self._scaling is not None:
            state["scaling"] = self._scaling.summary()
        return state

    # ------------------------------------------------------------------ internals
    def _mark_down(self, worker_id: str) -> None:
        if self.dispatcher.mark_down(worker_id):
            logger.warning("worker %s is down; placing its work elsewhere", worker_id)

    def _quiet(self) -> bool:
        """Nothing to plan and no autoscaler to feed: the planner may wake and read the monitor less often."""
        return not len(self.dispatcher.queue) and self._scaling is None

    async def _run(self) -> None:
        while True:
            tick = self.config.idle_interval_s if self._quiet() else self.config.plan_interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick)
            self._wake.clear()
            try:
                self._refresh_stats()
                self._plan_all()
                self._autoscale()
            except Exception:  # the planner must survive a bad figure or a dead worker
                logger.exception("controller planning failed")

    def _plan_now(self) -> None:
        try:
            self._plan_all()
        except Exception:  # the caller's request is queued all the same; the loop plans it again
            logger.exception("controller planning failed")

    def _refresh_stats(self) -> None:
        """Keep the monitor's figures fresh without ever waiting for them: planning goes on from the last figures
        while a read runs in the background, and from the controller's own ledger once they are too old."""
        if self._monitor is None:
            return
        now = time.monotonic()
        refresh = self.config.idle_interval_s if self._quiet() else self.config.stats_refresh_s
        if self._stats_read is None and now - self._stats_asked >= refresh:
            self._stats_asked = now
            self._stats_read = asyncio.get_running_loop().create_task(self._read_stats())
        age = now - self._stats_at
        limit = self.config.stats_max_age_s if self._stats_seen else self.config.stats_first_wait_s
        if not self._stats_stale and age > limit:
            # Once per outage, not per tick; a worker's old free-block count could hold planning at zero for ever.
            self._stats_stale = True
            self.dispatcher.update_stats({}, ())
            logger.warning(
                "monitor figures are %.1f s old (%s); planning from the controller's own ledger until it answers",
                age,
                self._stats_error or "no answer yet",
            )

    async def _read_stats(self) -> None:
        try:
            summary = await self._monitor.summary.remote()  # type: ignore[union-attr]
        except Exception as e:  # the monitor is gone or failed: keep planning, say so once (above)
            self._stats_error = f"{type(e).__name__}: {e}"
            return
        finally:
            self._stats_read = None
        steps = {
            wid: row["batch_latency_ms"] / 1000.0
            for wid, row in summary.get("workers", {}).items()
            if row.get("role") == "decode" and row.get("up", True) and row.get("batch_latency_ms") is not None
        }
        self.dispatcher.update_stats(
            summary.get("free_kv_blocks", {}),
            # A worker that reported once and then went silent is down; one not yet seen is starting.
            (wid for wid, row in summary.get("workers", {}).items() if not row.get("up", True)),
            steps,
        )
        self._decode_step_s = max(steps.values()) if steps else None
        self._stats_at = time.monotonic()
        self._stats_seen = True
        self._stats_error = None
        if self._stats_stale:
            self._stats_stale = False
            logger.warning("monitor figures are fresh again")
        self._wake.set()  # new figures may let a waiting batch fit

    # ------------------------------------------------------------------ autoscaling
    def _autoscale(self) -> None:
        """Evaluate the policy (bucket_manager/autoscale.py) for each role, act on it, and retire drained workers."""
        s = self._scaling
        now = time.monotonic()
        if s is None or now - self._scaled_at < self.config.scaling_interval_s:
            return
        self._scaled_at = now
        d, cfg = self.dispatcher, s.config
        oldest = d.oldest_queued_arrival()
        wait = None if oldest is None else max(0.0, time.time() - oldest)
        for role in ROLES:
            serving, busy, kv_usage = d.role_load(role)
            s.observe(
                role,
                now,
                pressure(
                    role,
                    cfg,
                    wait,
                    kv_usage,
                    busy,
                    serving,
                    self._decode_step_s if role == "decode" else None,
                ),
                idle(role, cfg, len(d.queue), busy, kv_usage),
            )
            step = s.step(role, now, serving)
            if step > 0:
                self._scale_up(role, now, wait, kv_usage)
            elif step < 0:
                self._scale_down(role, now)
        for worker_id in [w for w in s.draining if d.drained(w)]:
            self._retire(worker_id, now)
        for worker_id in s.overdue(now, self.config.scaling_start_timeout_s):
            logger.error(
                "%s did not join within %.0f s of its start; stopping it",
                worker_id,
                self.config.scaling_start_timeout_s,
            )
            self._stop_worker(worker_id)

    def _scale_up(self, role: str, now: float, wait: float | None, kv_usage: float) -> None:
        try:
            worker_id = self._spawner.start(role)
        except Exception:
            logger.exception("could not start a %s worker", role)
            return
        self._scaling.started(role, worker_id, now)  # type: ignore[union-attr]
        why = (
            f"oldest queued request waited {wait:.2f} s"
            if role == "prefill"
            else f"KV {kv_usage:.0%} promised, slowest step {(self._decode_step_s or 0.0) * 1e3:.0f} ms"
        )
        logger.warning("scaling %s up: starting %s (%s)", role, worker_id, why)
        self._record_scaling(role, "up")

    def _scale_down(self, role: str, now: float) -> None:
        d = self.dispatcher
        candidates = d.usable(role)
        if len(candidates) < 2:
            return
        # The least loaded; among equals the newest (the launcher's first workers stay).
        victim = max(candidates, key=lambda w: (-(len(w.outstanding) + len(w.reserved)), w.worker_id))
        d.drain(victim.worker_id)
        self._scaling.drain(role, victim.worker_id, now)  # type: ignore[union-attr]
        logger.warning("scaling %s down: draining %s", role, victim.worker_id)
        self._record_scaling(role, "down")

    def _retire(self, worker_id: str, now: float) -> None:
        self.dispatcher.remove_worker(worker_id)
        self.handles.pop(worker_id, None)
        self._close_channel(worker_id)
        self._retired.add(worker_id)
        event = self._scaling.removed(worker_id, now)  # type: ignore[union-attr]
        logger.warning(
            "%s drained and removed after %.1f s",
            worker_id,
            (event.done_at - event.decided_at) if event else 0.0,
        )
        asyncio.get_running_loop().call_later(self.config.retire_grace_s, self._stop_worker, worker_id)
        self._wake.set()

    def _stop_worker(self, worker_id: str) -> None:
        try:
            self._spawner.stop(worker_id)
        except Exception as e:
            logger.warning("could not stop %s: %s", worker_id, e)

    async def _join(self, worker_id: str, kv_blocks: int) -> None:
        """A worker the autoscaler started is warmed: into the ledger, the prefill workers told its KV address (or
        it theirs), then planned for."""
        d = self.dispatcher
        event = self._scaling.starting[worker_id]  # type: ignore[union-attr]
        self.handles[worker_id] = ray.get_actor(worker_id, namespace=self.config.namespace)
        d.add_worker(event.role, worker_id, kv_blocks)
        self._retired.discard(worker_id)
        await self._share_decode_peers(back=worker_id)
        d.revive(worker_id, kv_blocks)
        self._scaling.serving(worker_id, time.monotonic())  # type: ignore[union-attr]
        logger.warning(
            "%s serving %.1f s after the decision (%d KV blocks)",
            worker_id,
            (event.done_at or 0.0) - event.decided_at,
            kv_blocks,
        )
        self._wake.set()

    def _record_scaling(self, role: str, direction: str) -> None:
        if self._monitor is not None:
            with contextlib.suppress(Exception):
                self._monitor.record_scaling.remote(role, direction)

    def _plan_all(self) -> None:
        for batch in self.dispatcher.plan(time.time()):
            if batch.lent:
                # A decode worker with slack prefills this batch in its own steps, then decodes it.
                logger.info(
                    "lent batch %d (%d prompts) to decode worker %s: the prefill workers are busy",
                    batch.batch_id,
                    len(batch.payloads),
                    batch.decode_id,
                )
                if self._monitor is not None:
                    with contextlib.suppress(Exception):
                        self._monitor.record_lent_batch.remote(batch.decode_id, len(batch.payloads))
                self.handles[batch.decode_id].run_prompts.remote(
                    batch.batch_id, list(batch.payloads), time.time()
                )
                continue
            items = [(payload, batch.decode_id) for payload in batch.payloads]
            cores = tuple(sorted({c for did in batch.borrowed for c in self._worker_cores.get(did, ())}))
            args = (batch.batch_id, items, time.time(), cores)
            channel = self._dispatch_channel(batch.prefill_id)
            frame = encode_frame(args) if channel is not None else None
            if frame is None or not channel.send(frame):  # type: ignore[union-attr]
                self.handles[batch.prefill_id].enqueue.remote(*args)
            # After the batch is on its way: the monitor is not on the prompt's path.
            if batch.borrowed and self._monitor is not None:
                with contextlib.suppress(Exception):
                    for did in batch.borrowed:
                        self._monitor.record_core_lend.remote(did)
        for prefill_id, batch_id in self.dispatcher.withdrawals(time.time()):
            key = (prefill_id, batch_id)
            if key not in self._withdrawing and prefill_id in self.handles:
                self._withdrawing.add(key)
                task = asyncio.get_running_loop().create_task(self._take_back(prefill_id, batch_id))
                self._take_backs.add(task)
                task.add_done_callback(self._take_backs.discard)

    async def _take_back(self, prefill_id: str, batch_id: int) -> None:
        """Ask a prefill worker for a queued batch back, to lend it to a decode worker that freed up; a batch it has
        started (or a worker that does not answer) stays where it is."""
        try:
            given = await self.handles[prefill_id].withdraw.remote(batch_id)
        except Exception as e:
            logger.warning("could not take batch %d back from %s: %s", batch_id, prefill_id, e)
            given = False
        finally:
            self._withdrawing.discard((prefill_id, batch_id))
        if not given:
            self.dispatcher.keep(prefill_id, batch_id)  # started already: not asked again
            return
        back = self.dispatcher.take_back(prefill_id, batch_id)
        logger.info(
            "took batch %d (%d prompts) back from %s's queue: a decode worker is free to prefill it sooner",
            batch_id,
            len(back),
            prefill_id,
        )
        self._wake.set()

    # ------------------------------------------------------------------ dispatch sockets
    def _dispatch_channel(self, worker_id: str) -> DispatchChannel | None:
        """The open socket to prefill worker ``worker_id``, or None (the batch goes by Ray): then one is asked for
        in the background, unless an open is under way or the last one failed less than a retry period ago."""
        channel = self._channels.get(worker_id)
        if channel is not None and channel.open:
            return channel
        if worker_id not in self._opening and time.monotonic() >= self._channel_retry_at.get(worker_id, 0.0):
            self._opening.add(worker_id)
            asyncio.get_running_loop().create_task(self._open_channel(worker_id))
        return None

    async def _open_channel(self, worker_id: str) -> None:
        try:
            handle = self.handles.get(worker_id)
            if handle is None:
                return
            node, path = await asyncio.wait_for(
                handle.dispatch_channel.remote(), self.config.recover_timeout_s
            )
            if self.handles.get(worker_id) is not handle:
                return  # retired or replaced meanwhile: the next dispatch asks its successor
            here = this_node_id()
            if not node or node != here:
                # Another node: Ray is the way there, for good.
                self._channel_retry_at[worker_id] = float("inf")
                return
            self._channels[worker_id] = DispatchChannel(path)
            logger.info("batches for %s go over its dispatch socket", worker_id)
        except Exception as e:  # not answering (restarting, gone): Ray carries its batches meanwhile
            logger.info("no dispatch socket to %s yet: %s", worker_id, e)
            self._channel_retry_at[worker_id] = time.monotonic() + CHANNEL_RETRY_S
        finally:
            self._opening.discard(worker_id)

    def _close_channel(self, worker_id: str) -> None:
        channel = self._channels.pop(worker_id, None)
        if channel is not None:
            channel.close()
        self._channel_retry_at.pop(worker_id, None)

    def _publish_buckets(self, queue: RequestBuckets) -> None:
        bounds = queue.bounds()
        if self._monitor is None or bounds == self._bounds:
            return
        self._bounds = bounds
        edges = [b[0] for b in bounds] + [bounds[-1][1]]
        with contextlib.suppress(Exception):
            self._monitor.set_buckets.remote(edges, queue.sizes())
