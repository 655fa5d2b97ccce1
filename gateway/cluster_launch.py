"""Launching the Ray side of the cluster: monitor, controller and workers as named actors, as a
:class:`ClusterConfig` describes them.

``launch_cluster`` starts them and waits until every worker has loaded and warmed its model;
``connect_cluster`` finds an already running cluster by its actor names (a Ray Serve replica does this).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

import ray
from ray.actor import ActorHandle

from bucket_manager.autoscale import ScalingConfig
from bucket_manager.controller import Controller, ControllerConfig
from bucket_manager.lending import LendingPolicy
from bucket_manager.priority import PriorityPolicy
from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from gateway.ray_network import local_ray_init, warn_unless_token_auth
from kv_transfer.config import CLUSTER_TRANSPORTS, TransferConfig
from kv_transfer.faults import FaultInjector
from monitor import Monitor, MonitorConfig
from prefill_worker.worker import PrefillWorker
from worker.actor import EngineWorker
from worker.colocated import ColocatedWorker
from worker.config import WorkerConfig, check_count, check_optional_count
from worker.info import DecodePeer, WorkerInfo

logger = logging.getLogger(__name__)

MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class ClusterConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    mode: str = "disaggregated"
    prefill_workers: int = 1
    decode_workers: int = 1
    # Colocated mode: how many colocated workers.
    colocated_workers: int = 1
    # Colocated mode, workers on a CPU: their step token budget in place of the engine config's (None: that
    # one; see engine.config.COLOCATED_CPU_STEP_TOKENS).
    colocated_cpu_step_tokens: int | None = None
    kv_transport: str = "grpc"
    transfer: TransferConfig = field(default_factory=TransferConfig)
    # Prefill workers send each layer's KV as soon as it is computed (False: each request's KV after its batch;
    # None: each prefill worker decides, see worker.config.layer_streaming).
    stream_kv_layers: bool | None = None
    # Chaos drills and fault tests only: damage done to the prefill workers' outgoing KV chunks (None: none).
    kv_faults: FaultInjector | None = None
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    policy: PriorityPolicy = field(default_factory=PriorityPolicy)
    # Controller scheduling: "buckets" (adaptive request buckets + priority policy) or "fcfs" (one bucket,
    # arrival order: the baseline the benchmarks compare against).
    scheduling: str = "buckets"
    # Elastic prefill: a decode worker that decodes nothing lends its steps to prompt batches while every prefill
    # worker already holds one, and a burst is split over the idle workers (bucket_manager/lending.py).
    elastic: bool = True
    # Elastic too: a prefill batch runs on the cores of the idle decode workers pinned beside its prefill worker
    # (a lone prompt prefills on every core of a small host). Needs pin_cores.
    share_cores: bool = True
    # Elastic too: a prompt batch that needs the cores of busy decode workers beside it to meet its TTFT target pauses
    # them for its forward pass when that takes at most this many ms (0: only idle ones lend their cores).
    pause_decode_ms: int = 800
    # Ray: None starts a local cluster in-process; "auto" or "ray://host:port" joins one.
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    namespace: str = "bucketserve"
    # Prefix of every actor name, so two clusters can share one Ray namespace.
    name: str = "bucketserve"
    # Ray CPUs per worker actor; torch threads per worker; pin prefill and decode to separate cores.
    worker_num_cpus: float = 1.0
    # Ray resources each prefill / decode worker asks for besides worker_num_cpus, which place the role on the nodes
    # that offer them: a node group's custom resource ({"prefill": 1}), {"GPU": 1} on CUDA, {"HPU": 1} on Gaudi.
    # Colocated workers take decode_resources. Empty: any node with the CPUs.
    prefill_resources: Mapping[str, float] = field(default_factory=dict)
    decode_resources: Mapping[str, float] = field(default_factory=dict)
    # None: 1 per disaggregated worker (each pinned to its own core); a colocated worker's share of the cores.
    num_threads: int | None = None
    pin_cores: bool = True
    # Admission bound: requests in flight through one gateway beyond this get 429 (a batch of more prompts
    # than this, which could never be admitted, gets 400).
    max_pending: int = 256
    max_batches_per_prefill_worker: int = 2
    # How many times in its life Ray re-creates a worker that died (a crash, its process killed): bounded, so a
    # worker that dies while starting (out of memory, say) ends the launch instead of looping.
    worker_max_restarts: int = 3
    # Long-poll timeout of the gateway's output drain calls.
    drain_timeout_s: float = 0.5
    # A gateway takes the outputs of the workers on its own node from their output sockets (worker/output_socket.py),
    # milliseconds sooner than the drain reply; False: every output comes by drain.
    local_outputs: bool = True
    # A worker whose drain call has not answered for this long is hung (alive, but its actor does not answer): the
    # gateway declares it down, as it does a dead one, and its requests end with an error. A drain answers within
    # drain_timeout_s when the worker is well, whatever its load.
    worker_timeout_s: float = 30.0
    # Seconds to wait for the workers to load and warm up.
    startup_timeout_s: float = 900.0
    # The model id clients send; None: the engine's model name.
    served_model_name: str | None = None
    # Actors outlive the process that started them (``serve run`` on an existing cluster).
    detached: bool = False
    # Leave out Ray's own start-up notices in this process and the workers' progress bars (model loading,
    # warm-up), which Ray relays late and out of order; the launcher logs one line per warmed worker instead.
    quiet: bool = True
    # Disaggregated mode: the controller adds and removes workers within these bounds (None: the counts above
    # stay as they are).
    scaling: ScalingConfig | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"ClusterConfig.mode must be one of {MODES}, got {self.mode!r}")
        for name in (
            "prefill_workers",
            "decode_workers",
            "colocated_workers",
            "max_pending",
            "max_batches_per_prefill_worker",
        ):
            check_count(self, name)
        for name in ("colocated_cpu_step_tokens", "num_threads", "ray_num_cpus"):
            check_optional_count(self, name)
        if not isinstance(self.local_outputs, bool):
            raise ValueError(f"ClusterConfig.local_outputs must be a bool, got {self.local_outputs!r}")
        if not isinstance(self.worker_max_restarts, int) or self.worker_max_restarts < 0:
            raise ValueError(
                f"ClusterConfig.worker_max_restarts must be an int >= 0, got {self.worker_max_restarts!r}"
            )
        for name in ("worker_num_cpus", "drain_timeout_s", "worker_timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"ClusterConfig.{name} must be > 0, got {value!r}")
        for name in ("prefill_resources", "decode_resources"):
            res = getattr(self, name)
            if not isinstance(res, Mapping):
                raise ValueError(f"ClusterConfig.{name} must be a mapping of resource -> amount, got {res!r}")
            for key, amount in res.items():
                if not isinstance(key, str) or not key:
                    raise ValueError(
                        f"ClusterConfig.{name}: resource names must be non-empty strings, got {key!r}"
                    )
                if key == "CPU":
                    raise ValueError(
                        f"ClusterConfig.{name}: give a worker's CPUs with ClusterConfig.worker_num_cpus, not 'CPU'"
                    )
                if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount > 0:
                    raise ValueError(f"ClusterConfig.{name}: {key!r} must be a number > 0, got {amount!r}")
        if self.scaling is not None:
            if self.mode != "disaggregated":
                raise ValueError("ClusterConfig.scaling needs mode disaggregated (its controller scales)")
            for role in ("prefill", "decode"):
                lo, hi = self.scaling.bounds(role)
                count = getattr(self, f"{role}_workers")
                if not lo <= count <= hi:
                    raise ValueError(
                        f"ClusterConfig.{role}_workers ({count}) must lie within ScalingConfig.min_{role}_workers "
                        f"({lo}) and ScalingConfig.max_{role}_workers ({hi})"
                    )
        if not self.worker_timeout_s > self.drain_timeout_s:
            # An idle worker's drain answers only after drain_timeout_s: anything shorter would call it hung.
            raise ValueError(
                f"ClusterConfig.worker_timeout_s must be more than the {self.drain_timeout_s:g} s an idle worker's "
                f"drain call takes (drain_timeout_s), got {self.worker_timeout_s!r}"
            )
        if self.kv_transport not in CLUSTER_TRANSPORTS:
            raise ValueError(
                f"ClusterConfig.kv_transport must be one of {CLUSTER_TRANSPORTS} (the transports that work "
                f"between worker actors), got {self.kv_transport!r}"
            )
        if self.scheduling not in ("buckets", "fcfs"):
            raise ValueError(f"ClusterConfig.scheduling must be 'buckets' or 'fcfs', got {self.scheduling!r}")
        if not isinstance(self.elastic, bool):
            raise ValueError(f"ClusterConfig.elastic must be a bool, got {self.elastic!r}")
        if not isinstance(self.share_cores, bool):
            raise ValueError(f"ClusterConfig.share_cores must be a bool, got {self.share_cores!r}")
        if (
            not isinstance(self.pause_decode_ms, int)
            or isinstance(self.pause_decode_ms, bool)
            or self.pause_decode_ms < 0
        ):
            raise ValueError(
                f"ClusterConfig.pause_decode_ms must be an int >= 0, got {self.pause_decode_ms!r}"
            )
        if not self.name or not self.namespace:
            raise ValueError("ClusterConfig.name and ClusterConfig.namespace must be non-empty")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    def worker_threads(self) -> int:
        """Torch threads of each worker: a colocated engine uses every core it is given."""
        if self.num_threads is not None:
            return self.num_threads
        if self.mode == "colocated":
            return max(1, (os.cpu_count() or 1) // self.colocated_workers)
        return 1

    def actor_name(self, role: str, index: int | None = None) -> str:
        return f"{self.name}:{role}" if index is None else f"{self.name}:{role}-{index}"

    def role_resources(self, role: str) -> dict[str, float]:
        """The Ray resources (besides CPUs) a worker of ``role`` asks for."""
        return dict(self.prefill_resources if role == "prefill" else self.decode_resources)

    def worker_ids(self) -> list[tuple[str, str]]:
        """(role, actor name) of every worker."""
        if self.mode == "colocated":
            return [("colocated", self.actor_name("colocated", i)) for i in range(self.colocated_workers)]
        return [("prefill", self.actor_name("prefill", i)) for i in range(self.prefill_workers)] + [
            ("decode", self.actor_name("decode", i)) for i in range(self.decode_workers)
        ]

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


class WorkerActor(NamedTuple):
    """One worker actor of the cluster."""

    role: str  # "prefill", "decode" or "colocated"
    handle: ActorHandle[EngineWorker]


@dataclass
class ClusterHandles:
    config: ClusterConfig
    monitor: ActorHandle[Monitor]
    controller: ActorHandle[Controller] | None  # disaggregated mode only
    workers: dict[str, WorkerActor]  # by actor name
    infos: dict[str, WorkerInfo]  # by actor name
    launched: bool
    startup_s: float = 0.0

    def by_role(self, role: str) -> dict[str, ActorHandle[EngineWorker]]:
        return {n: h for n, (r, h) in self.workers.items() if r == role}

    def engine_info(self) -> WorkerInfo:
        """The engine facts (model, block size, context and batch limits, shape buckets) every worker shares:
        all load the same model with the same engine config, so any one worker's info tells them."""
        return next(iter(self.infos.values()))


def ensure_ray(config: ClusterConfig) -> None:
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {
        "namespace": config.namespace,
        "include_dashboard": False,
        "log_to_driver": True,
        "logging_level": logging.WARNING if config.quiet else logging.INFO,
    }
    if config.ray_address is not None:
        ray.init(address=config.ray_address, **kwargs)
        warn_unless_token_auth(config.ray_address)
    else:
        # Room for every worker plus the gateway, whatever the core count of this machine; on loopback only.
        needed = int(len(config.worker_ids()) * config.worker_num_cpus) + 2
        local_ray_init(num_cpus=config.ray_num_cpus or max(os.cpu_count() or 1, needed), **kwargs)


class ClusterTooSmall(RuntimeError):
    """The Ray cluster can never hold the workers' CPUs: said at once instead of waiting for ever."""


def _autoscaler_limits() -> dict[str, float] | None:
    """The most of each resource the cluster's autoscaler may bring up; None without an autoscaler's config."""
    from ray._private.state import state  # Ray Train's check of its workers asks the same

    try:
        return state.get_max_resources_from_cluster_config()
    except Exception as e:  # a Ray without it: judge by the nodes alone
        logger.debug("no autoscaler limits: %s", e)
        return None


def _max_cluster_cpus() -> float | None:
    """The most CPUs this Ray cluster can have: its autoscaler's limit where it has one, else what its nodes
    have now; None when an autoscaler's config does not say."""
    limits = _autoscaler_limits()
    now = float(ray.cluster_resources().get("CPU", 0.0))
    if limits is None:
        return now
    if "CPU" not in limits:
        return None
    return max(now, float(limits["CPU"]))


def check_cluster_cpus(config: ClusterConfig) -> None:
    """Raise :class:`ClusterTooSmall` when the workers ask for more Ray CPUs than the cluster can ever have
    (a worker that cannot be placed waits silently; under ``serve run`` so does the application)."""
    need = len(config.worker_ids()) * config.worker_num_cpus
    have = _max_cluster_cpus()
    if have is not None and need > have + 1e-9:
        raise ClusterTooSmall(
            f"the {len(config.worker_ids())} workers need {need:g} Ray CPUs (worker_num_cpus "
            f"{config.worker_num_cpus:g} each) but the Ray cluster has {have:g}: lower worker_num_cpus "
            f"or give Ray more CPUs (ray start --num-cpus N, more nodes)"
        )


def _placement_options(config: ClusterConfig, role: str) -> dict[str, Any]:
    """Ray actor options placing a worker of ``role``: Ray takes GPUs as ``num_gpus`` (it then sets the actor's
    CUDA_VISIBLE_DEVICES), any other resource in ``resources``."""
    res = config.role_resources(role)
    gpus = res.pop("GPU", None)
    out: dict[str, Any] = {"resources": res} if res else {}
    if gpus:
        out["num_gpus"] = gpus
    return out


def _offers(node_resources: Mapping[str, float], need: Mapping[str, float]) -> bool:
    return all(node_resources.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def check_placement(config: ClusterConfig) -> None:
    """Raise :class:`ClusterTooSmall` when a role's resources (``prefill_resources``, ``decode_resources``) are
    offered by no node of the cluster, nor by any its autoscaler may add: such a worker would wait for ever."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    limits = _autoscaler_limits()
    roles = sorted({role for role, _ in config.worker_ids()})
    for role in roles:
        need = {**config.role_resources(role), "CPU": config.worker_num_cpus}
        if len(need) == 1 or any(_offers(n.get("Resources", {}), need) for n in nodes):
            continue
        if limits and all(k in limits for k in need):
            continue  # the autoscaler knows node types with these: it will add one
        key = "decode_resources" if role == "colocated" else f"{role}_resources"
        offered = "; ".join(
            f"{n.get('NodeManagerAddress', '?')}: "
            + ", ".join(
                f"{k} {v:g}" for k, v in sorted(n.get("Resources", {}).items()) if not k.startswith("node:")
            )
            for n in nodes
        )
        raise ClusterTooSmall(
            f"no node of the Ray cluster offers {key} {dict(config.role_resources(role))} with worker_num_cpus "
            f"{config.worker_num_cpus:g} for the {role} workers; its nodes offer: {offered or 'nothing'}. Start a "
            f"node with them (ray start --resources '{{\"{next(iter(config.role_resources(role)))}\": 1}}', or "
            f"--num-gpus) or change {key}"
        )


def _cores(role: str, index: int, config: ClusterConfig) -> tuple[int, ...]:
    """Prefill workers take cores from the front, decode workers from the back, so they never share one; colocated
    workers take equal shares in order."""
    if not config.pin_cores:
        return ()
    n = os.cpu_count() or 1
    if role == "prefill":
        return (index % n,)
    if role == "decode":
        return ((n - 1 - index) % n,)
    # Colocated: a share of the cores each, while the shares fit the node (beyond that, unpinned).
    t = config.worker_threads()
    if (index + 1) * t > n:
        return ()
    return tuple(range(index * t, (index + 1) * t))


def _neighbour_cores(role: str, index: int, config: ClusterConfig) -> tuple[tuple[int, str], ...]:
    """(core, owner's actor name) of a colocated worker's neighbours, whose cores its long prompt chunks may borrow
    (``share_cores``)."""
    if role != "colocated" or not config.share_cores or not _cores(role, index, config):
        return ()
    return tuple(
        (c, config.actor_name(role, i))
        for i in range(config.colocated_workers)
        if i != index
        for c in _cores(role, i, config)
    )


# tqdm (transformers' loading bars, the engine's warm-up bar) reads TQDM_DISABLE when it is imported, so it is
# set in the actor's environment before its process starts.
_QUIET_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def worker_runtime_env(config: ClusterConfig) -> dict | None:
    """A worker's Ray runtime_env: when quiet, no progress bars."""
    return {"env_vars": dict(_QUIET_ENV)} if config.quiet else None


# TASK_EVENTS_NOTE: the cluster's actors take calls without pause (every gateway long-polls every worker, workers
# report to the monitor several times a second); Ray's task events for each call (kept in its GCS for its task
# list) grew the GCS process by about 15 MiB a minute in a 10-minute soak. Their calls are not recorded there.
_CLASSES = {"prefill": PrefillWorker, "decode": DecodeWorker, "colocated": ColocatedWorker}


def with_kv_token(config: ClusterConfig) -> ClusterConfig:
    """``config`` with a KV auth token: its own, or a random one made for this cluster, so that the workers' KV
    endpoints never answer a caller without it."""
    if config.transfer.auth_token:
        return config
    return replace(config, transfer=replace(config.transfer, auth_token=secrets.token_urlsafe(32)))


def start_worker(
    config: ClusterConfig, role: str, index: int, joins: bool = False
) -> ActorHandle[EngineWorker]:
    """Create worker ``index`` of ``role`` (returns at once: it loads and warms up in its own process). ``joins``:
    started into a running cluster, it tells the controller once it is warmed."""
    name = config.actor_name(role, index)
    controller_name = config.actor_name("controller") if config.mode == "disaggregated" else None
    wcfg = WorkerConfig(
        worker_id=name,
        role=role,
        engine=config.engine,
        kv_transport=config.kv_transport,
        transfer=config.transfer,
        stream_kv_layers=config.stream_kv_layers,
        kv_faults=config.kv_faults if role == "prefill" else None,
        monitor_name=config.actor_name("monitor"),
        controller_name=controller_name,
        namespace=config.namespace,
        num_threads=config.worker_threads(),
        cpu_affinity=_cores(role, index, config),
        joins=joins,
        cpu_step_tokens=config.colocated_cpu_step_tokens if role == "colocated" else None,
        neighbour_cores=_neighbour_cores(role, index, config),
        pause_neighbours_ms=config.pause_decode_ms if role == "colocated" else 0,
    )
    return (
        ray.remote(_CLASSES[role])
        .options(
            name=name,
            namespace=config.namespace,
            num_cpus=config.worker_num_cpus,
            max_concurrency=64,
            enable_task_events=False,  # see TASK_EVENTS_NOTE
            # A dead worker is re-created from the same config: it loads and warms the model again, then
            # rejoins (its requests in flight died with it and ended with an error).
            max_restarts=config.worker_max_restarts,
            runtime_env=worker_runtime_env(config),
            **_placement_options(config, role),
            # A worker the autoscaler adds is detached: created by the controller, it would otherwise die with the
            # controller's handle to it, or with the controller itself, which Ray restarts. stop_cluster and
            # stop_running stop it by name.
            **({"lifetime": "detached"} if config.detached or joins else {}),
        )
        .remote(wcfg)
    )


@dataclass(frozen=True)
class WorkerSpawner:
    """What the controller starts and stops workers with when it autoscales (see ``Controller``): the cluster's
    config, so that a worker it adds is made exactly as the launcher makes one."""

    config: ClusterConfig

    def candidates(self) -> list[tuple[str, str]]:
        assert self.config.scaling is not None
        return [
            (role, self.config.actor_name(role, i))
            for role in ("prefill", "decode")
            for i in range(self.config.scaling.bounds(role)[1] + 1)
        ]

    def start(self, role: str) -> str:
        """Start the lowest-numbered worker of ``role`` whose name is free; its name."""
        index = 0
        while _named(self.config.actor_name(role, index), self.config.namespace):
            index += 1
        start_worker(self.config, role, index, joins=True)
        return self.config.actor_name(role, index)

    def stop(self, worker_id: str) -> None:
        with contextlib.suppress(ValueError):  # already gone
            _stop_worker(ray.get_actor(worker_id, namespace=self.config.namespace))


def _stop_worker(handle: ActorHandle[EngineWorker]) -> None:
    """Ask a worker to shut down (it closes its KV endpoint and loop), then kill its actor."""
    try:
        ray.get(handle.shutdown.remote(), timeout=10)
    except Exception as e:  # already gone
        logger.debug("worker shutdown: %s", e)
    ray.kill(handle)


def launch_cluster(config: ClusterConfig) -> ClusterHandles:
    """Start monitor, workers and controller; return when every worker has loaded and warmed its model. The
    returned handles' config holds the KV token every worker was given."""
    config = with_kv_token(config)
    ensure_ray(config)
    # Before any actor exists: a failed build under `serve run` is retried, and must fail the same way.
    check_cluster_cpus(config)
    check_placement(config)
    t0 = time.perf_counter()
    ns = config.namespace
    life = {"lifetime": "detached"} if config.detached else {}
    monitor = (
        ray.remote(Monitor)
        .options(
            name=config.actor_name("monitor"),
            namespace=ns,
            num_cpus=0,
            max_concurrency=8,
            enable_task_events=False,  # see TASK_EVENTS_NOTE
            # A dead monitor comes back from its config (its store: Redis keeps the history, memory starts
            # empty); the workers' next heartbeats fill its worker table again. Reports sent while it was down
            # are dropped, not retried: they are fire-and-forget and the next ones supersede them.
            max_restarts=-1,
            **life,
        )
        .remote(config.monitor)
    )
    workers: dict[str, WorkerActor] = {}
    counts: dict[str, int] = {}
    for role, name in config.worker_ids():
        index = counts.get(role, 0)
        counts[role] = index + 1
        handle = start_worker(config, role, index)
        workers[name] = WorkerActor(role, handle)
    refs = {w.handle.info.remote(): name for name, w in workers.items()}
    infos: dict[str, WorkerInfo] = {}
    pending = list(refs)
    deadline = time.monotonic() + config.startup_timeout_s
    while pending:  # in the order they finish, so the log reads as progress
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise TimeoutError(
                f"workers {sorted(refs[r] for r in pending)} not warmed after {config.startup_timeout_s:.0f}s"
            )
        name = refs[done[0]]
        info: WorkerInfo = ray.get(done[0])
        infos[name] = info
        logger.info(
            "[%d/%d] %s warmed in %.1fs (%d KV blocks, steps of at most %d tokens)",
            len(infos),
            len(refs),
            name,
            info.startup_s,
            info.kv_blocks_total,
            info.max_num_batched_tokens,
        )
    infos = {name: infos[name] for name in workers}  # launch order
    handles = ClusterHandles(config, monitor, None, workers, infos, True)
    if config.mode == "disaggregated":
        handles.controller = _launch_controller(handles, life)
    handles.startup_s = time.perf_counter() - t0
    logger.info("cluster %r (%s) ready in %.1fs", config.name, config.mode, handles.startup_s)
    return handles


def core_sharing(
    infos: Mapping[str, WorkerInfo],
) -> tuple[tuple[tuple[str, tuple[str, ...]], ...], tuple[tuple[str, tuple[int, ...]], ...]]:
    """(prefill worker, the decode workers on its node pinned to other cores) for each pinned prefill worker, and
    every pinned worker's cores: what ``ControllerConfig.core_neighbours`` and ``worker_cores`` take."""
    pinned = {n: i for n, i in infos.items() if i.cores and i.node_id}
    neighbours = tuple(
        (
            n,
            tuple(
                d
                for d, di in pinned.items()
                if di.role == "decode" and di.node_id == i.node_id and not set(di.cores) & set(i.cores)
            ),
        )
        for n, i in pinned.items()
        if i.role == "prefill"
    )
    return tuple((n, ds) for n, ds in neighbours if ds), tuple((n, i.cores) for n, i in pinned.items())


def controller_config(
    config: ClusterConfig, info: WorkerInfo, infos: Mapping[str, WorkerInfo] | None = None
) -> ControllerConfig:
    """The controller's config; ``infos`` (every worker's, by actor name) tell which workers share a node's cores."""
    neighbours, cores = core_sharing(infos or {})
    return ControllerConfig(
        block_size=info.block_size,
        max_model_len=info.max_model_len,
        max_num_batched_tokens=info.max_num_batched_tokens,
        shape_config=info.shape_config,
        monitor_name=config.actor_name("monitor"),
        namespace=config.namespace,
        policy=config.policy,
        max_batches_per_prefill_worker=config.max_batches_per_prefill_worker,
        scheduling=config.scheduling,
        lending=LendingPolicy(
            enabled=config.elastic and config.mode == "disaggregated",
            share_cores=config.share_cores,
            pause_decode_ms=config.pause_decode_ms,
        ),
        core_neighbours=neighbours,
        worker_cores=cores,
        workers=tuple((role, name) for role, name in config.worker_ids() if role in ("prefill", "decode")),
        scaling=config.scaling,
    )


def _launch_controller(handles: ClusterHandles, life: dict[str, str]) -> ActorHandle[Controller]:
    """Tell each prefill worker its decode peers, then start the controller and give it the workers and their KV
    capacity. A gateway that finds the controller waits for that registration (``connect_cluster``)."""
    config, infos = handles.config, handles.infos
    peers: dict[str, DecodePeer] = {}
    for n, h in handles.by_role("decode").items():
        address = infos[n].address
        if address is None:
            raise RuntimeError(f"decode worker {n} reported no KV address")
        peers[n] = DecodePeer(h, address)
    ray.get([h.set_decode_workers.remote(peers) for h in handles.by_role("prefill").values()])
    controller = (
        ray.remote(Controller)
        .options(
            name=config.actor_name("controller"),
            namespace=config.namespace,
            num_cpus=0,
            max_concurrency=1000,
            enable_task_events=False,  # see TASK_EVENTS_NOTE
            # A dead controller comes back from the same config and rebuilds its ledger from the workers; calls
            # made meanwhile wait for it (their callers bound each wait), and the gateways send again what its
            # queue held.
            max_restarts=-1,
            max_task_retries=-1,
            **life,
        )
        .remote(
            controller_config(config, handles.engine_info(), infos),
            WorkerSpawner(config) if config.scaling is not None and config.scaling.enabled else None,
        )
    )
    # The controller's ledger rows: actor name -> (handle, KV blocks).
    prefill = {n: (h, infos[n].kv_blocks_total) for n, h in handles.by_role("prefill").items()}
    decode = {n: (h, infos[n].kv_blocks_total) for n, h in handles.by_role("decode").items()}
    ray.get(controller.register_workers.remote(prefill, decode))
    return controller


def _wait_for_actor(name: str, namespace: str, deadline: float) -> ActorHandle:
    """The named actor, waiting for it to be created (a gateway may start while the cluster launches)."""
    while True:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:  # not created yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"actor {name!r} not found in Ray namespace {namespace!r}") from None
            time.sleep(0.25)


def connect_cluster(config: ClusterConfig) -> ClusterHandles:
    """Find a cluster's actors by name, waiting (up to ``startup_timeout_s``) for a cluster still launching: its
    workers to be created and warmed, then its controller, which starts after them."""
    ensure_ray(config)
    ns = config.namespace
    deadline = time.monotonic() + config.startup_timeout_s
    monitor = _wait_for_actor(config.actor_name("monitor"), ns, deadline)
    workers = {
        name: WorkerActor(role, _wait_for_actor(name, ns, deadline)) for role, name in config.worker_ids()
    }
    infos: dict[str, WorkerInfo] = {
        name: ray.get(w.handle.info.remote(), timeout=max(1.0, deadline - time.monotonic()))
        for name, w in workers.items()
    }
    controller = None
    if config.mode == "disaggregated":
        controller = _wait_for_actor(config.actor_name("controller"), ns, deadline)
        # Created before the launcher registers the workers with it: wait for that too.
        while not ray.get(controller.state.remote(), timeout=30)["prefill"]:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"controller {config.actor_name('controller')!r} has no workers registered"
                )
            time.sleep(0.1)
    return ClusterHandles(config, monitor, controller, workers, infos, False)


def stop_running(config: ClusterConfig) -> list[str]:
    """Stop the actors a cluster of this name left running in its namespace (a redeploy of a detached cluster, or
    one whose launcher died): workers are asked to shut down first, then every actor is killed. Returns their
    names; the names are free for a new launch once this returns."""
    prefix = f"{config.name}:"
    names = sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == config.namespace and a["name"].startswith(prefix)
    )
    found = {}
    for name in names:
        with contextlib.suppress(ValueError):  # gone meanwhile
            found[name] = ray.get_actor(name, namespace=config.namespace)
    workers = [h for n, h in found.items() if n.split(":", 1)[1].split("-")[0] in _CLASSES]
    for handle in workers:
        with contextlib.suppress(Exception):
            ray.get(handle.shutdown.remote(), timeout=10)
    for handle in found.values():
        with contextlib.suppress(Exception):
            ray.kill(handle)
    deadline = time.monotonic() + 30
    while any(_named(n, config.namespace) for n in found) and time.monotonic() < deadline:
        time.sleep(0.1)
    return list(found)


def _named(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
        return True
    except ValueError:
        return False


def stop_cluster(handles: ClusterHandles) -> None:
    # The controller first: an autoscaling one would otherwise start workers while these stop.
    if handles.controller is not None:
        ray.kill(handles.controller)
    for w in handles.workers.values():
        _stop_worker(w.handle)
    config = handles.config
    if config.scaling is not None:  # the workers it added, under names the launcher did not hand out
        spawner = WorkerSpawner(config)
        for _, name in spawner.candidates():
            if name not in handles.workers:
                spawner.stop(name)
    ray.kill(handles.monitor)
