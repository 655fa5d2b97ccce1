"""What every worker actor shares: process pinning, the engine, output buffers, stats and its :class:`WorkerInfo`."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import ray

from bucket_manager.controller import restarted_actor
from bucket_manager.local_socket import this_node_id
from engine.request import RequestOutput, mark_first_tokens
from kv_transfer.config import is_wildcard
from monitor import stages
from monitor.records import WorkerStats
from worker.config import WorkerConfig
from worker.cores import pin_process
from worker.heartbeat import Heartbeat, engine_worker_stats
from worker.info import WorkerInfo
from worker.messages import MessageRef, RequestMessage, resolve_messages
from worker.outbox import OutputBuffers
from worker.output_socket import OutputSocketServer

if TYPE_CHECKING:
    from kv_transfer import KVTransport

logger = logging.getLogger(__name__)

# How long a worker waits for the messages of a batch from its gateways' object stores.
MESSAGE_FETCH_S = 10.0

# The engine, torch and the transports are imported where a worker starts, not with this module: every process
# that holds a worker's actor handle (the controller, each gateway replica) imports the actor's class module
# when it receives the handle, and should not load torch and transformers for it (3 s of the controller's start).


def lookup_actor(name: str | None, namespace: str | None = None):
    """A named actor of the cluster. Its namespace is given explicitly: inside an actor, Ray's default is the
    namespace of the job that started the actor (``serve run``'s, say), not the cluster's."""
    if name is None:
        return None
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        logger.warning("actor %r not found; not reporting to it", name)
        return None


class EngineWorker:
    role = ""

    def __init__(self, config: WorkerConfig) -> None:
        if config.role != self.role:
            raise ValueError(
                f"WorkerConfig.role must be {self.role!r} for a {type(self).__name__}, got {config.role!r}"
            )
        self.config = config
        self.cores = pin_process(config.num_threads, config.cpu_affinity)
        t0 = time.perf_counter()
        from engine.llm_engine import LLMEngine

        # Warm-up happens here, unless the engine config skips it.
        self.engine = LLMEngine(config.engine)
        self.startup_s = time.perf_counter() - t0
        self.outputs = OutputBuffers()
        # Gateways on this node take their outputs from here rather than from the drain reply (faster by ms).
        self.output_socket = OutputSocketServer(self.outputs.attach, config.worker_id)
        self._closed = threading.Event()
        self._latency_ms: float | None = None
        self._integrity_error: str | None = None
        self._controller = None
        self.heartbeat = Heartbeat(
            lookup_actor(config.monitor_name, config.namespace), self._stats, config.heartbeat_s
        )

    def _get_controller(self):
        """The cluster's controller (disaggregated mode), looked up on first use: it starts after the workers."""
        if self._controller is None and self.config.controller_name is not None:
            self._controller = lookup_actor(self.config.controller_name, self.config.namespace)
        return self._controller

    def _fetch_messages(self, payloads: list[RequestMessage | MessageRef]) -> list[RequestMessage | None]:
        """The messages of a batch the controller handed this worker (``resolve_messages``). One that cannot be
        had went away with its gateway: nobody is left to answer, so the controller is told to drop it (its
        reservations go) and it is None here."""
        msgs = resolve_messages(payloads, MESSAGE_FETCH_S)
        lost = [p.request_id for p, m in zip(payloads, msgs, strict=True) if m is None]
        if lost:
            logger.warning(
                "dropped %d request(s) whose gateway is gone with their messages: %s", len(lost), lost
            )
            controller = self._get_controller()
            if controller is not None:
                for rid in lost:
                    controller.abort.remote(rid)
        return msgs

    def _open_kv_transport(self) -> KVTransport:
        """The KV transport of a disaggregated role, over this worker's cache and allocator."""
        from kv_transfer import create_transport

        c = self.config
        extra: dict[str, str] = {}
        if is_wildcard(c.transfer.host):  # listening on every address: peers dial this node's own
            extra["advertise_host"] = ray.util.get_node_ip_address()
        return create_transport(
            c.kv_transport,
            self.engine.kv_cache,
            self.engine.allocator,
            c.transfer,
            faults=c.kv_faults,
            **extra,
        )

    def _start(self, loop) -> None:
        self._thread = threading.Thread(target=loop, name=f"{self.role}-loop", daemon=True)
        self._thread.start()
        self.heartbeat.start()
        logger.info("%s worker %s up in %.1fs", self.role, self.config.worker_id, self.startup_s)
        self._rejoin()

    def _rejoin(self) -> None:
        """After Ray restarted this actor (it died; Ray re-created it from the same config), or once warmed when the
        autoscaler started it (``joins``): tell the controller it is up, with its capacity, so it is planned for and
        the prefill workers learn its KV address. Nothing to do on a launcher's first start (the launcher registers
        the workers) or without a controller."""
        restarted = restarted_actor()
        if not (restarted or self.config.joins):
            return
        controller = self._get_controller()
        logger.warning("%s %s the cluster", self.config.worker_id, "rejoining" if restarted else "joining")
        if controller is not None:
            controller.worker_up.remote(self.config.worker_id, self.engine.allocator.num_blocks, time.time())

    # ------------------------------------------------------------------ remote API
    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(
            worker_id=self.config.worker_id,
            role=self.role,
            warmed=True,
            startup_s=self.startup_s,
            warmup=dict(e.warmup_report),
            kv_blocks_total=e.allocator.num_blocks,
            block_size=e.block_size,
            max_model_len=e.config.scheduler.max_model_len,
            max_num_batched_tokens=e.config.scheduler.max_num_batched_tokens,
            shape_config=e.buckets.config,
            eos_token_ids=tuple(e.eos_token_ids),
            model_path=str(e.loaded.path),
            device=e.device.name,
            dtype=e.config.dtype,
            shape_policy=e.config.shape_policy,
            node_id=this_node_id(),
            cores=self.cores,
        )

    def drain(self, consumer_id: str, timeout: float = 0.5, ack: int = -1) -> tuple[int, list[RequestOutput]]:
        """Every output for this consumer not yet acknowledged; waits up to ``timeout`` when there is none."""
        return self.outputs.drain(consumer_id, timeout, ack)

    def output_channel(self) -> tuple[str, str]:
        """``(node id, path)`` of this worker's output socket: a gateway on the same node attaches there."""
        node = this_node_id()
        return node, self.output_socket.path

    def stats(self) -> dict:
        a = self.engine.allocator
        return {
            "worker_id": self.config.worker_id,
            "role": self.role,
            "kv_blocks_total": a.num_blocks,
            "kv_blocks_free": a.num_free,
            "kv_blocks_used": a.num_used,
            "running": len(self.engine.running),
            "integrity_error": self._integrity_error,
            "runtime_compilations": self.engine.runner.runtime_compilations,
            "shape_policy": self.engine.config.shape_policy,
            "max_num_batched_tokens": self.engine.config.scheduler.max_num_batched_tokens,
            "outputs_by_socket": self.outputs.sent_by_socket,
            "outputs_by_drain": self.outputs.sent_by_drain,
            **self.engine.stats,
        }

    def _close(self) -> None:
        self._closed.set()
        self.heartbeat.close()
        self.outputs.wake()
        self.output_socket.close()
        self.outputs.close()

    # ------------------------------------------------------------------ helpers
    def _timed_step(self) -> list[RequestOutput]:
        start = time.time()
        t0 = time.perf_counter()
        outs = self.engine.step()
        ms = (time.perf_counter() - t0) * 1e3
        self._latency_ms = ms if self._latency_ms is None else 0.8 * self._latency_ms + 0.2 * ms
        return mark_first_tokens(outs, {stages.FORWARD_START: start, stages.FORWARD_END: start + ms / 1e3})

    def _check_integrity(self) -> bool:
        """free + used == total and no block held twice; False (and logged) when not."""
        try:
            self.engine.check_integrity()
        except AssertionError as e:
            self._integrity_error = str(e)
            logger.error("%s: KV integrity check failed: %s", self.config.worker_id, e)
            return False
        self._integrity_error = None
        return True

    def _queue_len(self) -> int:
        return len(self.engine.waiting)

    def _stats(self) -> WorkerStats:
        return engine_worker_stats(
            self.engine, self.config.worker_id, self.role, True, self._latency_ms, self._queue_len()
        )
