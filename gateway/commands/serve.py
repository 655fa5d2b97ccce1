"""``bucketserve serve``: start the cluster (monitor, controller, prefill/decode or colocated workers) and the
OpenAI-compatible gateway on Ray Serve.

Every flag has a key of the same name (dashes or underscores) in the ``--config`` YAML file; flags given on the
command line win over the file, and an unknown key is an error that names it. Without ``--address`` a local Ray
cluster is started in this process. ``build_serve_app`` is the application builder behind
``serve run deploy/serve_config.yaml`` on an existing Ray cluster.
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

# Keys of the parser that are not serving settings (the CLI's own).
_NOT_CONFIG = {"func", "command", "log_level", "config"}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from engine.args import add_engine_args
    from kv_transfer.config import CLUSTER_TRANSPORTS

    add_engine_args(p)
    p.add_argument("--config", default=None, help="YAML file whose keys are these flags' names")
    p.add_argument(
        "--mode",
        default="disaggregated",
        choices=["disaggregated", "colocated"],
        help="colocated: each worker's one engine does prefill and decode",
    )
    p.add_argument(
        "--scheduling",
        default="buckets",
        choices=["buckets", "fcfs"],
        help="disaggregated controller: adaptive request buckets + priorities, or one FCFS queue (baseline)",
    )
    p.add_argument(
        "--online-order",
        default="arrival",
        choices=["arrival", "deadline", "sjf"],
        help="buckets scheduling: order of online requests (sjf: shortest prompt first, oldest after 10 s)",
    )
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--colocated-workers", type=int, default=1)
    p.add_argument("--kv-transport", default="grpc", choices=list(CLUSTER_TRANSPORTS))
    p.add_argument(
        "--no-kv-stream-layers",
        action="store_true",
        help="send each request's KV after its prefill batch instead of layer by layer during it",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None, help="Ray cluster address; none: start Ray in-process")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer <key> on /v1/*")
    p.add_argument("--redis-url", default=None, help="monitor store in Redis (default: in memory)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    p.add_argument("--max-pending", type=int, default=256, help="requests in flight per gateway before 429")
    p.add_argument("--worker-num-cpus", type=float, default=1.0, help="Ray CPUs per worker actor")
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads per worker (default: 1 per disaggregated worker, each on its own core; a colocated "
        "worker gets its share of the cores)",
    )
    p.add_argument("--no-pin-cores", action="store_true", help="do not pin workers to separate cores")
    p.add_argument("--gateway-replicas", type=int, default=1)
    p.add_argument("--name", default="bucketserve", help="prefix of the cluster's Ray actor names")


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model on a Ray cluster behind an OpenAI-compatible API")
    add_serve_args(p)
    p.set_defaults(func=run)


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bucketserve serve")
    add_serve_args(parser)
    return parser


def config_keys(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Config-file keys (dashes or underscores) as flag destinations; an unknown key is an error."""
    parser = _serve_parser()
    known = {a.dest for a in parser._actions} - _NOT_CONFIG - {"help"}
    out = {}
    for key, value in (data or {}).items():
        dest = str(key).replace("-", "_")
        if dest not in known:
            raise ValueError(f"{source}: unknown key {key!r}; known keys: {sorted(known)}")
        out[dest] = value
    return out


def load_config_file(path: str) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of flag names to values, got {type(data).__name__}")
    return config_keys(data, path)


def apply_config_file(args: argparse.Namespace) -> argparse.Namespace:
    """Fill from ``--config`` every setting the command line left at its default (flags win)."""
    if not getattr(args, "config", None):
        return args
    defaults = vars(_serve_parser().parse_args([]))
    merged = dict(vars(args))
    for dest, value in load_config_file(args.config).items():
        if merged.get(dest) == defaults.get(dest):
            merged[dest] = value
    return argparse.Namespace(**merged)


def cluster_config_from_args(args: argparse.Namespace, detached: bool = False):
    from bucket_manager.priority import PriorityPolicy
    from engine.config import config_from_args
    from gateway.cluster_launch import ClusterConfig
    from monitor import MonitorConfig

    return ClusterConfig(
        engine=config_from_args(args),
        mode=args.mode,
        scheduling=args.scheduling,
        policy=PriorityPolicy(online_order=args.online_order),
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        colocated_workers=args.colocated_workers,
        kv_transport=args.kv_transport,
        stream_kv_layers=not args.no_kv_stream_layers,
        monitor=MonitorConfig.for_url(args.redis_url),
        ray_address=args.address,
        name=args.name,
        worker_num_cpus=args.worker_num_cpus,
        num_threads=args.num_threads,
        pin_cores=not args.no_pin_cores,
        max_pending=args.max_pending,
        served_model_name=args.served_model_name,
        detached=detached,
    )


def connect_backend(config):
    """Run inside each gateway replica: connect to the cluster launched under ``config.name``."""
    from gateway.cluster_backend import RayClusterBackend

    return RayClusterBackend(config, launch=False)


def _settings(config, api_key: str | None):
    from gateway.settings import GatewaySettings

    return GatewaySettings(backend_factory=functools.partial(connect_backend, config), api_key=api_key)


def build_serve_app(cli_args: dict[str, Any]):
    """Application builder for ``serve run``: ``cli_args`` holds the same keys as the config file."""
    import gateway.app
    from gateway.cluster_launch import launch_cluster

    parser = _serve_parser()
    parser.set_defaults(**config_keys(cli_args, "serve config args"))
    args = parser.parse_args([])
    config = cluster_config_from_args(args, detached=True)
    launch_cluster(config)
    return gateway.app.build_app(_settings(config, args.api_key), num_replicas=args.gateway_replicas)


def run(args: argparse.Namespace) -> int:
    try:
        args = apply_config_file(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from gateway.cluster_launch import ensure_ray, launch_cluster, stop_cluster

    try:
        config = cluster_config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    # Ctrl-C during start-up (minutes of warm-up) interrupts it, also when the shell started this process with
    # SIGINT ignored (a background job), which would otherwise make it deaf to SIGINT until it serves.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ensure_ray(config)
        logger.info(
            "loading %s and warming up %d worker(s)...", config.engine.model, len(config.worker_ids())
        )
        handles = launch_cluster(config)
    except KeyboardInterrupt:
        print("interrupted during start-up", file=sys.stderr, flush=True)
        ray.shutdown()
        return 130
    import gateway.app

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = gateway.app.build_app(_settings(config, args.api_key), num_replicas=args.gateway_replicas)
        serve.run(app, name="bucketserve", route_prefix="/", blocking=False)
        base = f"http://{args.host}:{args.port}"
        ready_s = time.perf_counter() - t0
        print(f"BucketServe ({config.mode}) ready in {ready_s:.1f}s, model {config.model_name!r}", flush=True)
        print(f"  OpenAI API  {base}/v1  (completions, chat/completions, models)", flush=True)
        print(f"  health      {base}/health", flush=True)
        print(f"  metrics     {base}/metrics", flush=True)
        print(f"  dashboard   {base}/dashboard", flush=True)
        print("Ctrl-C to stop.", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        logger.info("stopping...")
        try:
            serve.shutdown()
        finally:
            stop_cluster(handles)
            ray.shutdown()
    return 0
