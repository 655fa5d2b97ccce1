"""``RayClusterBackend``: the gateway's view of the Ray cluster (controller, prefill/decode or colocated
workers, monitor).

Outputs come back by long-poll: one task per worker calls ``drain(consumer_id)`` and fans the outputs out to
the per-request streams, so the hot path costs one Ray call per worker step, not one per token per request.
In disaggregated mode a request's first token comes from its prefill worker and the rest from its decode
worker; each stream puts them in order by token index (and drops a first token sampled again after a
re-plan).

No wait here is unbounded: the gateway bounds a request's submission and each wait for its outputs by the
request's deadline (``gateway/deadline.py``), the clean-up calls after it ends are bounded by
``CALL_TIMEOUT_S``, and a worker whose drain call stops answering for ``ClusterConfig.worker_timeout_s`` is
declared down as a dead one is.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import ray
from ray.actor import ActorHandle

from bucket_manager.dispatch_socket import DispatchChannel, encode_frame
from bucket_manager.memory_budget import safe_blocks
from engine.request import FinishReason, Request, RequestOutput
from gateway.backend import ModelInfo, Overloaded, Rejected, ServingBackend, Unavailable
from gateway.cluster_launch import (
    ClusterConfig,
    ClusterHandles,
    WorkerActor,
    connect_cluster,
    launch_cluster,
    stop_cluster,
)
from monitor import stages
from monitor.records import RequestRecord
from worker.actor import EngineWorker
from worker.info import WorkerInfo
from worker.messages import MessageRef, RequestMessage, payload_of
from worker.output_socket import connect_output_socket, encode_hello, read_frame

logger = logging.getLogger(__name__)

# The most a clean-up call (release, abort) may take; the controller's abort itself waits up to 2 s on each worker.
CALL_TIMEOUT_S = 10.0
# How often each gateway asks which life of the controller answers (a restart is noticed within about this).
CONTROLLER_WATCH_S = 0.5
# Turns of the event loop a poller lets pass after handing outputs to their requests, before it sends its next drain
# call (about a millisecond of Ray's submission path on this loop): the request's task reads the output in the first;
# a first token then takes several more to go out (the handler's wait for it ends, the response starts, its first
# chunk is written). With 2 turns the drain call came first: 40 streamed requests on a 2-core host, alternating, took
# 7.3-7.7 ms p50 from the prefill worker's output to the client's first chunk, against 6.6-7.0 ms with 8.
CONSUMER_TURNS = 8
# After a worker's output socket closed (the worker restarted, or fell back to the drain under a burst the socket
# could not buffer), or could not be reached: wait this long before attaching again; the drain carries meanwhile.
REATTACH_S = 1.0
# After the controller's submit socket failed or could not be opened: ask again this long after (Ray carries the
# submits meanwhile).
SUBMIT_SOCKET_RETRY_S = 5.0


class _Stream:
    """One request's outputs, in token order, whichever worker they came from."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.delivered = 0
        self.pending: dict[int, RequestOutput] = {}
        self.worker: ActorHandle[EngineWorker] | None = None  # colocated mode: the worker that runs it
        self.worker_name: str | None = None
        self.prompt_tokens = (
            0  # colocated mode: the prompt's length (its worker's load until its first token)
        )
        self.message: RequestMessage | None = None  # disaggregated mode: what was submitted to the controller
        self.payload: RequestMessage | MessageRef | None = None  # ... and what the controller passes on

    def push(self, out: RequestOutput) -> None:
        n = len(out.new_token_ids)
        if n == 0:  # an error or abort without tokens: ends the stream now
            self.queue.put_nowait(out)
            return
        start = out.num_generated_tokens - n
        if start > self.delivered:
            self.pending[start] = out  # the decode worker overtook the prefill worker's first token
            return
        if start + n <= self.delivered:
            return  # sampled again after a re-plan: already sent
        skip = self.delivered - start
        if skip:
            out = dataclasses.replace(
                out, new_token_ids=out.new_token_ids[skip:], new_logprobs=out.new_logprobs[skip:]
            )
        self.queue.put_nowait(out)
        self.delivered = out.num_generated_tokens
        nxt = self.pending.pop(self.delivered, None)
        if nxt is not None:
            self.push(nxt)


class RayClusterBackend(ServingBackend):
    """``launch=True`` starts the cluster's actors (and Ray, when it is not running); ``launch=False`` connects
    to a cluster already started under the same names (a Ray Serve replica)."""

    def __init__(self, config: ClusterConfig, launch: bool = True) -> None:
        self.config = config
        self.handles: ClusterHandles = launch_cluster(config) if launch else connect_cluster(config)
        info = self.handles.engine_info()
        self._info = ModelInfo(
            name=config.model_name,
            path=info.model_path,
            max_model_len=info.max_model_len,
            eos_token_ids=tuple(info.eos_token_ids),
        )
        self._block_size = info.block_size
        role = "colocated" if config.mode == "colocated" else "decode"
        self._decode_capacity = min(
            safe_blocks(i.kv_blocks_total) for i in self.handles.infos.values() if i.role == role
        )
        self.consumer_id = f"gw-{uuid.uuid4().hex[:12]}"
        self._streams: dict[str, _Stream] = {}
        self._pollers: list[asyncio.Task] = []
        self._worker_pollers: dict[str, asyncio.Task] = {}  # worker id -> its drain loop
        # Worker id (a worker on this node) -> the reader of its output socket.
        self._socket_readers: dict[str, asyncio.Task] = {}
        self._node_id = ray.get_runtime_context().get_node_id()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._down: set[str] = set()
        self._background: set[asyncio.Task] = set()
        # Per worker: the sequence number of the last drain answer received (acknowledged with the next call).
        self._acks: dict[str, int] = {}
        self._closed = False
        # The controller's life this gateway submitted to; when another answers, the queue died with the old one.
        self._incarnation: str | None = None
        # A controller on this node takes submits over its socket (bucket_manager/dispatch_socket.py): the open
        # channel, whether an open is under way, and when to ask again after a failure.
        self._submit_channel: DispatchChannel | None = None
        self._submit_opening = False
        self._submit_retry_at = 0.0
        self.submits_by_socket = 0
        if self.handles.controller is not None:
            self._incarnation = ray.get(self.handles.controller.get_incarnation.remote(), timeout=60)
            try:  # now, so that the first requests take it too
                self._adopt_submit_channel(
                    *ray.get(self.handles.controller.submit_channel.remote(), timeout=60)
                )
            except Exception as e:
                logger.info("no submit socket to the controller yet: %s: %s", type(e).__name__, e)
                self._submit_retry_at = time.monotonic() + SUBMIT_SOCKET_RETRY_S

    @property
    def startup_s(self) -> float:
        return self.handles.startup_s

    # ------------------------------------------------------------------ ServingBackend
    def model_info(self) -> ModelInfo:
        return self._info

    def max_in_flight(self) -> int:
        return self.config.max_pending

    def _check(self, req: Request) -> None:
        if self._closed:
            raise Unavailable("the cluster is shutting down")
        limit = self._info.max_model_len
        n = req.num_prompt_tokens
        if n >= limit:
            raise Rejected(f"prompt has {n} tokens; max_model_len is {limit} (prompt + max_tokens must fit)")
        if n + req.sampling.max_tokens > limit:
            raise Rejected(
                f"max_tokens is {req.sampling.max_tokens} but the prompt has {n} tokens; prompt + max_tokens "
                f"must be <= max_model_len ({limit})"
            )
        need = -(-(n + req.sampling.max_tokens) // self._block_size)
        if need > self._decode_capacity:
            raise Rejected(
                f"prompt + max_tokens needs {need} KV blocks; a worker's cache holds {self._decode_capacity}"
            )
        for role in ("colocated",) if self.config.mode == "colocated" else ("prefill", "decode"):
            if all(name in self._down for name in self.handles.by_role(role)):
                raise Unavailable(f"every {role} worker is down; the cluster cannot serve requests")
        if req.request_id in self._streams:
            raise Rejected(f"request id {req.request_id!r} is already in flight")
        if len(self._streams) >= self.config.max_pending:
            raise Overloaded(
                f"{len(self._streams)} requests in flight (limit {self.config.max_pending})", 1.0
            )

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        self._check(req)
        self._ensure_pollers()
        rid = req.request_id
        stream = _Stream()
        self._streams[rid] = stream
        finished = False
        submitting: asyncio.Future | None = None
        try:
            msg = RequestMessage.from_request(req, self.consumer_id)
            # Its own task, so a caller that gives up (deadline, disconnect) does not cut it short: its abort is
            # sent once the submission has landed, never ahead of it (Ray does not order the calls of one caller
            # to an async actor).
            submitted = {stages.SUBMITTED: time.time()}
            submitting = asyncio.ensure_future(self._submit(msg, stream))
            # Arrivals feed the monitor's arrival rate and mean prompt length (the controller's N_max figures);
            # fire-and-forget: the monitor is for operators and planning, serving does not wait on it. Sent once
            # the submission is on its way: a Ray call costs this process about a millisecond.
            submitting.add_done_callback(
                lambda _: self.handles.monitor.record_arrival.remote(
                    req.priority_class.value, req.num_prompt_tokens
                )
            )
            try:
                await asyncio.shield(submitting)
            except Exception as e:
                # The controller or the chosen worker is gone: a clear 503, not an unexplained 500.
                raise Unavailable(f"could not submit the request to the cluster: {type(e).__name__}") from e
            while True:
                out = await stream.queue.get()
                finished = out.finished
                if submitted is not None:
                    out = out.marked(submitted)
                    submitted = None
                yield out
                if finished:
                    break
        finally:
            self._streams.pop(rid, None)
            # Clean up in a task: this may run while the caller's task is being cancelled.
            cleanup = self._release(rid) if finished else self._abort_placed(rid, stream, submitting)
            task = asyncio.get_running_loop().create_task(cleanup)
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def settle(self) -> None:
        """Wait for the clean-up calls already started (release of finished requests, aborts of abandoned ones);
        a caller about to close its event loop (a script, a test) calls this so none is dropped unsent."""
        while pending := [t for t in self._background if not t.done()]:
            await asyncio.gather(*pending, return_exceptions=True)

    async def _submit(self, msg: RequestMessage, stream: _Stream) -> None:
        if self.config.mode == "colocated":
            workers = list(self.handles.by_role("colocated").items())
            live = [(n, h) for n, h in workers if n not in self._down] or workers
            # A cheap local proxy of each worker's load, from this gateway's requests in flight: the prompt tokens
            # it has yet to answer with a first token (a new prompt waits behind them), then the requests.
            load = {n: [0, 0] for n, _ in live}
            for s in self._streams.values():
                for n, h in live:
                    if s.worker is h:
                        load[n][0] += s.prompt_tokens if s.delivered == 0 else 0
                        load[n][1] += 1
            name, handle = min(live, key=lambda nh: load[nh[0]])
            stream.worker = handle
            stream.worker_name = name
            stream.prompt_tokens = msg.num_prompt_tokens
            await handle.submit.remote(msg)
            return
        stream.message = msg  # sent again should the controller restart before it dispatched the request
        # The controller plans with the summary and passes the payload on unread: the message itself for a prompt
        # that fits a call, else a reference into the object store (the prompt then goes to the worker only).
        stream.payload = payload_of(msg)
        channel = self._controller_channel()
        frame = encode_frame((msg.summary(), stream.payload)) if channel is not None else None
        if frame is not None and channel.send(frame):  # type: ignore[union-attr]
            # Written whole: the controller reads it unless it dies first, and then the restart watch sends it
            # again (it has no token yet). Its abort, by Ray, may overtake it: the controller drops it then.
            self.submits_by_socket += 1
            return
        await self.handles.controller.submit.remote(msg.summary(), stream.payload)

    def _controller_channel(self) -> DispatchChannel | None:
        """The open submit socket to the controller, or None (the submit goes by Ray): then one is asked for in the
        background, unless an open is under way or the last failed less than a retry period ago."""
        channel = self._submit_channel
        if channel is not None and channel.open:
            return channel
        if not self._submit_opening and time.monotonic() >= self._submit_retry_at:
            self._submit_opening = True
            task = asyncio.get_running_loop().create_task(
                self._open_controller_channel(), context=contextvars.Context()
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return None

    async def _open_controller_channel(self) -> None:
        controller = self.handles.controller
        try:
            node, path = await asyncio.wait_for(controller.submit_channel.remote(), CALL_TIMEOUT_S)
            if self.handles.controller is controller:
                self._adopt_submit_channel(node, path)
        except Exception as e:  # restarting, or gone: Ray carries the submits meanwhile
            logger.info("no submit socket to the controller yet: %s: %s", type(e).__name__, e)
            self._submit_retry_at = time.monotonic() + SUBMIT_SOCKET_RETRY_S
        finally:
            self._submit_opening = False

    def _adopt_submit_channel(self, node: str, path: str) -> None:
        if not node or node != self._node_id:
            self._submit_retry_at = float("inf")  # another node: Ray is the way there, for good
            return
        self._submit_channel = DispatchChannel(path)
        logger.info("submits go over the controller's socket")

    def _close_controller_channel(self) -> None:
        if self._submit_channel is not None:
            self._submit_channel.close()
            self._submit_channel = None
        self._submit_retry_at = 0.0

    async def _release(self, rid: str) -> None:
        if self.handles.controller is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.handles.controller.release.remote(rid), CALL_TIMEOUT_S)

    async def _abort_placed(
        self, rid: str, stream: _Stream | None, submitting: asyncio.Future | None = None
    ) -> None:
        try:
            if submitting is not None:
                # Submitted or failed: either way nothing more is on its way to the cluster. (A failed submission
                # may still have landed; the abort of an id the cluster does not hold does nothing.)
                await asyncio.wait({submitting}, timeout=CALL_TIMEOUT_S)
                if submitting.done() and not submitting.cancelled():
                    submitting.exception()  # retrieved: the caller reported it, if it was still listening
            if self.handles.controller is not None:
                call = self.handles.controller.abort.remote(rid)
            elif stream is not None and stream.worker is not None:
                call = stream.worker.abort.remote(rid)
            else:
                call = asyncio.gather(
                    *(h.abort.remote(rid) for h in self.handles.by_role("colocated").values()),
                    return_exceptions=True,
                )
            await asyncio.wait_for(call, CALL_TIMEOUT_S)
        except Exception as e:
            logger.warning("abort of %s failed: %s: %s", rid, type(e).__name__, e)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.queue.put_nowait(
                RequestOutput(request_id, [], [], True, FinishReason.ABORT, 0, stream.delivered)
            )
        await self._abort_placed(request_id, stream)

    async def health(self) -> dict:
        async def probe(name: str, role: str, handle: ActorHandle[EngineWorker]) -> dict:
            try:
                info: WorkerInfo = await asyncio.wait_for(handle.info.remote(), 5.0)
                return {"id": name, "role": role, "up": True, "warmed": info.warmed}
            except Exception as e:
                return {"id": name, "role": role, "up": False, "warmed": False, "error": type(e).__name__}

        rows = await asyncio.gather(*(probe(n, r, h) for n, (r, h) in self.handles.workers.items()))
        for row in rows:
            if row["up"] and row["id"] in self._down:
                # It answers again (restarted) but this gateway has not had its first drain from it yet.
                row.update(up=False, error="rejoining")
        controller_up = True
        if self.handles.controller is not None:
            try:
                await asyncio.wait_for(self.handles.controller.state.remote(), 5.0)
            except Exception:
                controller_up = False
        ready = not self._closed and controller_up and all(r["up"] and r["warmed"] for r in rows)
        return {
            "ready": ready,
            "mode": self.config.mode,
            "model": self._info.name,
            "controller_up": controller_up,
            "workers": list(rows),
            "in_flight": len(self._streams),
        }

    async def stale_actors(self) -> list[str]:
        held = {self.config.actor_name("monitor"): self.handles.monitor}
        held |= {name: w.handle for name, w in self.handles.workers.items()}
        if self.handles.controller is not None:
            held[self.config.actor_name("controller")] = self.handles.controller

        def lookup() -> list[str]:
            stale = []
            for name, handle in held.items():
                try:
                    running = ray.get_actor(name, namespace=self.config.namespace)
                except ValueError:  # none under that name: nothing newer to connect to
                    continue
                if running != handle:  # handles compare by actor id
                    stale.append(name)
            return stale

        return await asyncio.to_thread(lookup)

    async def metrics_text(self) -> str:
        return await self.handles.monitor.metrics_text.remote(self._info.name)

    async def dashboard_data(self, window_s: float) -> dict:
        return await self.handles.monitor.dashboard_data.remote(window_s)

    async def record(self, rec: RequestRecord) -> None:
        # Fire-and-forget, as arrivals are: no answer waits on the monitor (or on its store, Redis).
        self.handles.monitor.record_request.remote(rec)

    async def worker_stats(self) -> dict[str, dict]:
        """Each worker's own figures (KV blocks free/used/total, ...), read directly."""
        names = list(self.handles.workers)
        stats = await asyncio.gather(*(self.handles.workers[n].handle.stats.remote() for n in names))
        return dict(zip(names, stats, strict=True))

    async def shutdown(self) -> None:
        self._closed = True
        for t in [*self._pollers, *self._worker_pollers.values(), *self._socket_readers.values()]:
            t.cancel()
        self._pollers = []
        self._worker_pollers = {}
        self._socket_readers = {}
        self._close_controller_channel()
        if self.handles.launched:
            await asyncio.get_running_loop().run_in_executor(None, stop_cluster, self.handles)

    # ------------------------------------------------------------------ output collection
    def _ensure_pollers(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and (self._pollers or self._worker_pollers):
            return
        # A new event loop (tests, a restarted replica): the old tasks died with the old loop.
        self._loop = loop
        # A fresh context: created inside a request, the tasks would inherit its Ray Serve request context, and
        # Serve cancels the Ray calls of a request whose client disconnects (the drains of every stream).
        self._worker_pollers = {}
        self._socket_readers = {}
        for n, w in self.handles.workers.items():
            self._start_poller(n, w.handle)
        self._pollers = []
        if self.handles.controller is not None:
            self._pollers.append(loop.create_task(self._watch_controller(), context=contextvars.Context()))

    def _start_poller(self, name: str, handle: ActorHandle[EngineWorker]) -> None:
        loop = asyncio.get_running_loop()
        self._worker_pollers[name] = loop.create_task(self._poll(name, handle), context=contextvars.Context())
        if self.config.local_outputs:
            self._socket_readers[name] = loop.create_task(
                self._read_socket(name, handle), context=contextvars.Context()
            )

    def _stop_poller(self, name: str) -> None:
        for tasks in (self._worker_pollers, self._socket_readers):
            task = tasks.pop(name, None)
            if task is not None:
                task.cancel()

    async def _sync_members(self) -> None:
        """Follow the autoscaler: read from the workers the controller added, stop reading from those it removed
        (drained: they hold nothing of ours)."""
        members = await asyncio.wait_for(self.handles.controller.members.remote(), CALL_TIMEOUT_S)
        for name, role in members.items():
            if name in self.handles.workers:
                continue
            try:
                handle = await asyncio.to_thread(ray.get_actor, name, namespace=self.config.namespace)
            except ValueError:
                continue  # gone again meanwhile
            self.handles.workers[name] = WorkerActor(role, handle)
            self._start_poller(name, handle)
            logger.info("worker %s (%s) joined the cluster", name, role)
        for name in [n for n in self.handles.workers if n not in members]:
            self._stop_poller(name)
            self.handles.workers.pop(name)
            self._acks.pop(name, None)
            self._down.discard(name)
            logger.info("worker %s left the cluster", name)

    async def _watch_controller(self) -> None:
        """Notice a restarted controller (Ray brings it back from its config; it rebuilds its ledger from the
        workers) and send it again this gateway's requests that have not produced a token yet: those still queued
        died with the old one's queue, and those a worker holds it already knows (and ignores)."""
        controller = self.handles.controller
        while not self._closed:
            try:
                now = await asyncio.wait_for(controller.get_incarnation.remote(), CALL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # dead, or restarting: calls wait for its return
                logger.debug("controller watch: %s: %s", type(e).__name__, e)
                await asyncio.sleep(CONTROLLER_WATCH_S)
                continue
            if now != self._incarnation:
                logger.warning(
                    "the controller restarted; sending it this gateway's requests not yet under way"
                )
                self._incarnation = now
                self._close_controller_channel()  # its socket died with the old life; the next submit asks anew
                waiting = [
                    (s.message.summary(), s.payload)
                    for s in list(self._streams.values())
                    if s.message is not None and s.payload is not None and s.delivered == 0
                ]
                if waiting:
                    try:
                        await asyncio.wait_for(controller.resubmit.remote(waiting), CALL_TIMEOUT_S)
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:
                        logger.error("could not send requests again to the restarted controller: %s", e)
                        self._incarnation = None  # try again at the next look
            if self.config.scaling is not None:
                try:
                    await self._sync_members()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    logger.debug("member list: %s: %s", type(e).__name__, e)
            await asyncio.sleep(CONTROLLER_WATCH_S)

    async def _declare_down(self, name: str, why: str, hung: ActorHandle[EngineWorker] | None = None) -> None:
        """``name`` is down (``why``: "died", "stopped answering ..."): once, end what it held with an error."""
        if name in self._down:
            return
        logger.error("worker %s is down: it %s", name, why)
        self._down.add(name)
        self._acks.pop(name, None)  # a restarted worker numbers its answers afresh
        await self._fail_lost(name, why, hung)

    async def _fail_lost(self, name: str, why: str, hung: ActorHandle[EngineWorker] | None = None) -> None:
        """End with an error every stream of this gateway that cannot finish now that ``name`` is down.

        A ``hung`` worker (alive, not answering) is also told to abort them: the calls wait in its queue, so that if
        it ever answers again it frees what it holds for requests nobody awaits any more.
        """
        if self.handles.controller is not None:
            noticed_at = time.time()  # tells the controller which life of the worker this death was
            try:
                lost = await asyncio.wait_for(
                    self.handles.controller.worker_down.remote(name, noticed_at), 10.0
                )
            except Exception as e:
                logger.error("controller unreachable after %s went down: %s", name, e)
                # Without the controller nothing placed can finish: fail all rather than hang.
                lost = list(self._streams)
        else:
            lost = [rid for rid, s in self._streams.items() if s.worker_name == name]
        for rid in lost:
            if hung is not None:
                hung.abort.remote(rid)
            stream = self._streams.get(rid)
            if stream is not None:
                stream.push(
                    RequestOutput(
                        rid,
                        [],
                        [],
                        True,
                        FinishReason.ERROR,
                        0,
                        stream.delivered,
                        error=f"worker {name} {why} while serving this request; it was aborted",
                    )
                )

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.push(out)

    async def _read_socket(self, name: str, handle: ActorHandle[EngineWorker]) -> None:
        """Outputs of a worker on this node, from its output socket (``worker/output_socket.py``) as they are put.
        The worker's drain loop runs beside this one: it watches the worker's life and carries whatever the socket
        did not; the streams put the two in token order. Returns for a worker on another node."""
        while not self._closed:
            writer = None
            try:
                node, path = await asyncio.wait_for(handle.output_channel.remote(), CALL_TIMEOUT_S)
                if node != self._node_id:
                    return
                reader, writer = await asyncio.open_unix_connection(sock=connect_output_socket(path))
                writer.write(encode_hello(self.consumer_id))
                await writer.drain()
                logger.info("worker %s is on this node: reading its outputs from its local socket", name)
                while True:
                    self._deliver(await read_frame(reader))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # The worker died or restarted (its drain loop deals with that), or wrote to the drain instead.
                logger.debug("output socket of worker %s: %s: %s", name, type(e).__name__, e)
            finally:
                if writer is not None:
                    writer.close()
            await asyncio.sleep(REATTACH_S)

    async def _poll(self, name: str, handle: ActorHandle[EngineWorker]) -> None:
        timeout = self.config.worker_timeout_s
        call: asyncio.Future | None = None  # the drain call in flight
        try:
            while not self._closed:
                try:
                    if call is None:
                        ack = self._acks.get(name, -1)
                        call = asyncio.ensure_future(
                            handle.drain.remote(self.consumer_id, self.config.drain_timeout_s, ack)
                        )
                    done, _ = await asyncio.wait({call}, timeout=timeout)
                    if not done:
                        # Alive or not, it does not answer, so what it holds cannot finish. Keep waiting on the same
                        # call: its answer, if one ever comes, carries the outputs not yet acknowledged.
                        await self._declare_down(name, f"stopped answering for {timeout:g} s", handle)
                        continue
                    answered, call = call, None
                    seq, outs = answered.result()
                    self._acks[name] = seq
                    self._down.discard(name)
                except asyncio.CancelledError:
                    raise
                except ray.exceptions.RayActorError as e:
                    # The actor is dead (killed, crashed, its node gone): what it held cannot finish.
                    if name not in self._down:
                        logger.error("worker %s: %s", name, e)
                    await self._declare_down(name, "died")
                    await asyncio.sleep(1.0)
                    continue
                except Exception as e:
                    # Anything else (a cancelled or timed-out call) is not a death sentence: retry.
                    logger.warning(
                        "drain from worker %s failed (%s: %s); retrying", name, type(e).__name__, e
                    )
                    await asyncio.sleep(0.1)
                    continue
                self._deliver(outs)
                if outs:
                    # The requests' own tasks first (see CONSUMER_TURNS): sending the next drain call costs this loop
                    # about a millisecond of Ray's submission path.
                    for _ in range(CONSUMER_TURNS):
                        await asyncio.sleep(0)
        finally:
            if call is not None:
                call.cancel()
