"""``bucketserve serve``: start the cluster (monitor, controller, prefill/decode or colocated workers) and the
OpenAI-compatible gateway on Ray Serve.

Every flag has a key of the same name (dashes or underscores) in the ``--config`` YAML file; flags given on the
command line win over the file, and an unknown key is an error that names it. Without ``--address`` a local Ray
cluster is started in this process. ``build_serve_app`` is the application builder behind
``serve run deploy/serve_config.yaml`` on an existing Ray cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

# Keys of the parser that are not serving settings (the CLI's own).
_NOT_CONFIG = {"func", "command", "log_level", "config", "command_argv"}


EXAMPLES = """examples:
  bucketserve serve                                  # built-in random model: meaningless text, for trying it out
  bucketserve serve /models/Qwen2.5-0.5B-Instruct --max-model-len 4096
  bucketserve serve --mode colocated --api-key "$KEY" --port 9000
  bucketserve serve --config cluster.yaml --port 9001  # flags given here win over the file
  bucketserve serve --address auto --prefill-workers 2  # join a running Ray cluster
"""

# The API key may come from the environment (a Kubernetes Secret, for one), so that it need not appear in the
# process list or in a config file.
API_KEY_ENV = "BUCKETSERVE_API_KEY"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from engine.args import add_engine_args
    from gateway.direct_ingress import MODES as DIRECT_INGRESS_MODES
    from gateway.flags import port_number, resource_map
    from gateway.kv_flags import add_kv_security_args
    from kv_transfer.config import CLUSTER_TRANSPORTS

    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve, as --model (give one or the other)",
    )
    add_engine_args(p)
    p.add_argument(
        "--config", default=None, help="YAML file whose keys are these flags' names; flags given here win"
    )
    p.add_argument(
        "--mode",
        default="disaggregated",
        choices=["disaggregated", "colocated"],
        help="disaggregated: prefill and decode workers hand KV over; colocated: each worker's one engine does "
        "both",
    )
    p.add_argument(
        "--scheduling",
        default="buckets",
        choices=["buckets", "fcfs"],
        help="disaggregated controller: adaptive request buckets + priorities, or one FCFS queue (baseline)",
    )
    p.add_argument(
        "--elastic",
        default="on",
        choices=["on", "off"],
        help="disaggregated: a decode worker decoding at most 64 requests prefills prompt batches itself while the "
        "prefill workers are busy, and a burst is split over the workers that may run prompts",
    )
    p.add_argument(
        "--share-cores",
        default="on",
        choices=["on", "off"],
        help="disaggregated, with --elastic on: a prompt batch runs on the cores of the idle decode workers pinned "
        "beside its prefill worker too (a lone prompt prefills on every core of the node); colocated: a step with a "
        "long prompt chunk runs on the cores of the idle colocated workers beside it too",
    )
    p.add_argument(
        "--pause-decode-ms",
        type=int,
        default=800,
        help="disaggregated, with --share-cores on: a prompt batch that would miss its TTFT target on its prefill "
        "worker's cores alone, and meet it on the cores of the busy decode workers beside it too, pauses those "
        "decode workers for its forward pass when that takes at most this many ms (0: only idle ones lend); "
        "colocated: the same for a step's prompt chunk and the colocated workers beside it that only decode",
    )
    p.add_argument(
        "--online-order",
        default="arrival",
        choices=["arrival", "deadline", "sjf"],
        help="buckets scheduling: order of online requests (arrival, the default; TTFT deadline; sjf: shortest "
        "prompt first, the oldest first once it has waited 10 s: ahead under bursts of mixed lengths, behind on "
        "even Poisson load)",
    )
    p.add_argument(
        "--late-last",
        default="on",
        choices=["on", "off"],
        help="buckets scheduling: a request that can no longer meet its TTFT (past its deadline, or its prompt's "
        "prefill at the prefill workers' measured pace would end after it) goes after every request that still "
        "can, online or offline (the oldest online request goes first once it has waited 10 s)",
    )
    p.add_argument(
        "--prefill-workers",
        type=_worker_count,
        default=1,
        help="disaggregated mode: prefill worker actors, or auto (with --decode-workers auto): the split "
        "`bucketserve simulate --target-rate R --save-split` recommended for this model",
    )
    p.add_argument(
        "--decode-workers",
        type=_worker_count,
        default=1,
        help="disaggregated mode: decode worker actors, or auto",
    )
    p.add_argument("--colocated-workers", type=int, default=1, help="colocated mode: worker actors")
    p.add_argument(
        "--kv-transport",
        default="grpc",
        choices=list(CLUSTER_TRANSPORTS),
        help="how prefill workers send KV to decode workers (shm: same node only)",
    )
    p.add_argument(
        "--kv-stream-layers",
        default="auto",
        choices=["auto", "on", "off"],
        help="prefill workers send each layer's KV during the forward pass (on) or each request's KV after its "
        "batch (off); auto: off for a CPU prefill worker of one thread, whose one core would both compute and "
        "send, on otherwise (default: auto)",
    )
    p.add_argument("--no-kv-stream-layers", action="store_true", help="the same as --kv-stream-layers off")
    add_kv_security_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP gateway listens on")
    p.add_argument("--port", type=port_number, default=8000, help="port the HTTP gateway listens on")
    p.add_argument(
        "--address", default=None, help="join this Ray cluster ('auto': the local one); none: start Ray here"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and the dashboard's data (default: "
        f"${API_KEY_ENV}, where it is set)",
    )
    p.add_argument("--redis-url", default=None, help="monitor store in Redis (default: in memory)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    p.add_argument("--max-pending", type=int, default=256, help="requests in flight per gateway before 429")
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="a request not done by then is aborted: a 408, or a stream ends with a timeout error (a client asks "
        "for less with the x-request-timeout-ms header)",
    )
    p.add_argument(
        "--worker-timeout-s",
        type=float,
        default=30.0,
        help="a worker that does not answer the gateway for this long is declared down and its requests end "
        "with an error",
    )
    p.add_argument("--worker-num-cpus", type=float, default=1.0, help="Ray CPUs each worker actor asks for")
    for role in ("prefill", "decode"):
        for bound in ("min", "max"):
            p.add_argument(
                f"--{bound}-{role}-workers",
                type=int,
                default=None,
                help=f"autoscaling: the {'fewest' if bound == 'min' else 'most'} {role} workers the controller "
                f"keeps (default: --{role}-workers, no scaling)",
            )
    p.add_argument(
        "--scale-ttft-budget-s",
        type=float,
        default=1.0,
        help="autoscaling: a prefill worker is added when the oldest queued request has waited longer than this "
        "for 2 s",
    )
    p.add_argument(
        "--scale-tpot-budget-s",
        type=float,
        default=0.1,
        help="autoscaling: a decode worker is added when the slowest decode step has taken longer than this for 2 s "
        "(or more than 90%% of the decode KV is promised)",
    )
    p.add_argument(
        "--scale-idle-s",
        type=float,
        default=60.0,
        help="autoscaling: a worker is drained and removed after its role has been idle this long",
    )
    for role, example in (("prefill", "'{\"prefill\": 1}'"), ("decode", "'{\"GPU\": 1}'")):
        p.add_argument(
            f"--{role}-resources",
            type=resource_map,
            default=None,
            metavar="JSON",
            help=f"Ray resources each {role} worker asks for besides its CPUs, placing it on the nodes that offer "
            f"them, e.g. {example}; 'GPU' is Ray's GPU count, 'HPU' Gaudi's"
            + ("; colocated workers take these too" if role == "decode" else ""),
        )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads per worker (default: 1 per disaggregated worker, each on its own core; a colocated "
        "worker gets its share of the cores)",
    )
    p.add_argument("--no-pin-cores", action="store_true", help="do not pin workers to separate cores")
    p.add_argument(
        "--no-local-outputs",
        action="store_true",
        help="take every worker's outputs by Ray drain calls, also from workers on the gateway's own node (by "
        "default those push them over a local socket, milliseconds sooner)",
    )
    p.add_argument("--gateway-replicas", type=int, default=1, help="Ray Serve replicas of the HTTP gateway")
    p.add_argument(
        "--direct-ingress",
        choices=DIRECT_INGRESS_MODES,
        default="auto",
        help="on: the gateway replica answers HTTP on --port itself instead of behind Ray Serve's proxy, one "
        "process hop less per request and per streamed chunk (needs one gateway replica and a Ray cluster started "
        "here); auto: on where it can be; off: behind the proxy",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM or Ctrl-C: seconds open requests have to finish while new ones get 503; those still "
        "open then end with an error",
    )
    p.add_argument("--name", default="bucketserve", help="prefix of the cluster's Ray actor names")
    p.add_argument("--disable-log-requests", action="store_true", help="no access log line per HTTP request")
    p.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level of the HTTP gateway's replicas (their access log is at info)",
    )


def _worker_count(text: str) -> int | str:
    from gateway.worker_split import parse_worker_count

    try:
        return parse_worker_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(sub) -> None:
    from gateway.flags import HelpFormatter

    p = sub.add_parser(
        "serve",
        help="serve a model on a Ray cluster behind an OpenAI-compatible API",
        description="Start the cluster (monitor, controller, workers) and the OpenAI-compatible HTTP gateway. "
        "Every flag is checked before Ray starts.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    add_serve_args(p)
    p.set_defaults(func=run)


def _serve_parser() -> argparse.ArgumentParser:
    """``serve``'s own arguments as a parser of their own (config files, ``serve run``), with the subcommand's
    ``--log-level`` so that parsing the words after ``serve`` sees the same options as the command line."""
    from gateway.flags import add_log_level

    parser = argparse.ArgumentParser(prog="bucketserve serve")
    add_serve_args(parser)
    add_log_level(parser, top_level=False)
    return parser


def config_values(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Config keys (flag names, dashes or underscores) parsed by the flags' own types and choices."""
    from gateway.flags import values_from_mapping

    return values_from_mapping(_serve_parser(), data, source, skip=_NOT_CONFIG)


def resolve_settings(args: argparse.Namespace, argv: list[str] | None) -> argparse.Namespace:
    """defaults < ``--config`` file < flags given on the command line (``argv``: what followed ``serve``).

    Without ``argv`` (a programmatic call), every value that differs from its default counts as given.
    """
    from gateway.flags import FlagError, given_on_command_line, load_yaml_file

    parser = _serve_parser()
    defaults = vars(parser.parse_args([]))
    if argv is None:
        given = {k: v for k, v in vars(args).items() if k in defaults and v != defaults[k]}
    else:
        given = given_on_command_line(parser, argv)
    merged = dict(defaults)
    config_path = given.get("config")
    if config_path:
        merged.update(config_values(load_yaml_file(config_path), config_path))
    merged.update(given)
    tag = merged.pop("model_tag", None)
    if tag is not None:
        if "model" in given and given["model"] != tag:
            raise FlagError(f"the model is given twice ({tag!r} and --model {given['model']!r}): give one")
        merged["model"] = tag
    merged["model_tag"] = None
    extra = {k: v for k, v in vars(args).items() if k not in merged}  # the CLI's own (func, log_level, ...)
    return argparse.Namespace(**extra, **merged)


def _layer_streaming(args: argparse.Namespace) -> bool | None:
    """--kv-stream-layers as the cluster config's setting (None: auto, each prefill worker decides)."""
    if args.no_kv_stream_layers:
        if args.kv_stream_layers == "on":
            raise ValueError("--no-kv-stream-layers contradicts --kv-stream-layers on: give one")
        return False
    return {"auto": None, "on": True, "off": False}[args.kv_stream_layers]


def cluster_config_from_args(args: argparse.Namespace, detached: bool = False, quiet: bool = True):
    from bucket_manager.priority import PriorityPolicy
    from engine.config import COLOCATED_CPU_STEP_TOKENS, config_from_args
    from gateway.cluster_launch import ClusterConfig
    from gateway.kv_flags import transfer_config_from_args
    from gateway.worker_split import resolve_counts
    from monitor import MonitorConfig

    (prefill_workers, decode_workers), split = resolve_counts(
        args.prefill_workers, args.decode_workers, args.model, args.mode
    )
    if split is not None:
        logger.info("starting %s", split.describe())
    return ClusterConfig(
        engine=config_from_args(args),
        mode=args.mode,
        scheduling=args.scheduling,
        elastic=args.elastic == "on",
        share_cores=args.share_cores == "on",
        pause_decode_ms=args.pause_decode_ms,
        policy=PriorityPolicy(online_order=args.online_order, late_last=args.late_last == "on"),
        prefill_workers=prefill_workers,
        decode_workers=decode_workers,
        colocated_workers=args.colocated_workers,
        # A step budget given on the command line holds on every device.
        colocated_cpu_step_tokens=(
            COLOCATED_CPU_STEP_TOKENS
            if args.mode == "colocated" and args.max_num_batched_tokens is None
            else None
        ),
        kv_transport=args.kv_transport,
        transfer=transfer_config_from_args(args),
        stream_kv_layers=_layer_streaming(args),
        monitor=MonitorConfig.for_url(args.redis_url),
        ray_address=args.address,
        name=args.name,
        worker_num_cpus=args.worker_num_cpus,
        prefill_resources=args.prefill_resources or {},
        decode_resources=args.decode_resources or {},
        num_threads=args.num_threads,
        pin_cores=not args.no_pin_cores,
        local_outputs=not args.no_local_outputs,
        max_pending=args.max_pending,
        worker_timeout_s=args.worker_timeout_s,
        served_model_name=args.served_model_name,
        detached=detached,
        quiet=quiet,
        scaling=_scaling(args, {"prefill": prefill_workers, "decode": decode_workers}),
    )


def _scaling(args: argparse.Namespace, start: dict[str, int]):
    """The autoscaling bounds the flags ask for (``start``: each role's workers at start); None when they leave
    every count as it starts."""
    from bucket_manager.autoscale import ScalingConfig

    def given(name: str, default: int) -> int:
        value = getattr(args, name)
        return default if value is None else value

    bounds = {
        f"{bound}_{role}_workers": given(f"{bound}_{role}_workers", start[role])
        for role in ("prefill", "decode")
        for bound in ("min", "max")
    }
    if all(
        bounds[f"min_{r}_workers"] == bounds[f"max_{r}_workers"] == start[r] for r in ("prefill", "decode")
    ):
        return None
    return ScalingConfig(
        **bounds,
        scale_ttft_budget_s=args.scale_ttft_budget_s,
        scale_tpot_budget_s=args.scale_tpot_budget_s,
        scale_idle_s=args.scale_idle_s,
    )


def checked_cluster_config(args: argparse.Namespace, detached: bool = False, quiet: bool = True):
    """The cluster's config with every value checked, and the model's folder and limits read, before anything
    starts: errors are one line naming the flag (:class:`gateway.flags.FlagError`)."""
    from dataclasses import replace

    from engine.config import fit_to_model
    from engine.model_loader import ModelNotFoundError, read_model_facts
    from gateway.flags import FlagError, in_flag_terms

    parser = _serve_parser()
    try:
        config = cluster_config_from_args(args, detached=detached, quiet=quiet)
        facts = read_model_facts(config.engine.model)
        engine = fit_to_model(config.engine, facts.max_position_embeddings, facts.dtype)
    except ModelNotFoundError as e:
        raise FlagError(str(e)) from None
    except ValueError as e:  # every config class raises ValueError naming its field
        raise FlagError(in_flag_terms(parser, str(e))) from None
    if args.gateway_replicas < 1:
        raise FlagError(f"--gateway-replicas must be >= 1, got {args.gateway_replicas}")
    if args.direct_ingress == "on":
        from gateway import direct_ingress

        problem = direct_ingress.check(args.address, args.gateway_replicas)
        if problem is not None:
            raise FlagError(problem)
    try:
        _settings(config, args)
    except ValueError as e:
        raise FlagError(in_flag_terms(parser, str(e))) from None
    if not 0 <= args.drain_timeout_s < float("inf"):
        raise FlagError(f"--drain-timeout-s must be a number >= 0, got {args.drain_timeout_s}")
    return replace(config, engine=engine), facts


def connect_backend(config):
    """Run inside each gateway replica: connect to the cluster launched under ``config.name``."""
    from gateway.cluster_backend import RayClusterBackend

    return RayClusterBackend(config, launch=False)


def api_key(args: argparse.Namespace) -> str | None:
    """``--api-key`` (or the config's ``api_key``), else ``$BUCKETSERVE_API_KEY``; None when neither is set."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def _without_kv_token(config):
    """The cluster's config as a gateway replica gets it: the replicas never speak to a KV endpoint, so they are
    not given its token."""
    from dataclasses import replace

    return replace(config, transfer=replace(config.transfer, auth_token=None))


def _settings(config, args: argparse.Namespace, drain_signal: tuple[str, str] | None = None):
    from gateway.settings import GatewaySettings

    return GatewaySettings(
        backend_factory=functools.partial(connect_backend, _without_kv_token(config)),
        api_key=api_key(args),
        request_timeout_s=args.request_timeout_s,
        drain_signal=drain_signal,
        preload_tokenizer=config.engine.model,
    )


def _gateway_app(config, args: argparse.Namespace, drain_signal: tuple[str, str] | None = None):
    import gateway.app

    return gateway.app.build_app(
        _settings(config, args, drain_signal),
        num_replicas=args.gateway_replicas,
        logging_config={
            "log_level": args.uvicorn_log_level.upper(),
            "enable_access_log": not args.disable_log_requests,
        },
    )


def build_serve_app(cli_args: dict[str, Any]):
    """Application builder for ``serve run``: ``cli_args`` holds the same keys as the config file, read through
    the same parser (types, choices, one-line errors)."""
    from gateway.cluster_launch import ensure_ray, launch_cluster, stop_running

    parser = _serve_parser()
    parser.set_defaults(**config_values(cli_args, "serve config args"))
    args = parser.parse_args([])
    if args.direct_ingress == "on":
        from gateway.flags import FlagError

        # Serve runs already, started without it: direct ingress is the cluster's setting, not the app's.
        raise FlagError(
            "direct_ingress: under serve run, start the Ray cluster with RAY_SERVE_ENABLE_DIRECT_INGRESS=1 (and "
            "the port range of RAY_SERVE_DIRECT_INGRESS_MIN/MAX_HTTP_PORT) instead"
        )
    config, _ = checked_cluster_config(args, detached=True)
    ensure_ray(config)
    # A redeploy (changed config, an upgrade, serve run again) replaces the cluster its last build left running:
    # the config may differ, and its detached actors hold the names. The old gateway replicas fail their health
    # check against the new actors and are replaced too.
    replaced = stop_running(config)
    if replaced:
        logger.warning("replacing the running cluster %r (%d actors stopped)", config.name, len(replaced))
    launch_cluster(config)
    return _gateway_app(config, args)


def _one_line(error: BaseException) -> str:
    """The innermost cause of a start-up failure as one line (Ray wraps an actor's error in its own)."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "cause", None) or error.__cause__
        if not isinstance(inner, BaseException):
            break
        error = inner
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _banner(handles, args: argparse.Namespace, ready_s: float) -> list[str]:
    from gateway.flags import version

    config, info = handles.config, handles.engine_info()
    roles: dict[str, int] = {}
    for role, _ in config.worker_ids():
        roles[role] = roles.get(role, 0) + 1
    workers = " + ".join(f"{n} {role}" for role, n in roles.items())
    transfer = f", KV over {config.kv_transport}" if config.mode == "disaggregated" else ""
    base = f"http://{args.host}:{args.port}"
    return [
        f"BucketServe {version()} ready in {ready_s:.1f}s",
        f"  model       {config.model_name!r}  ({info.model_path})",
        f"  engine      {info.device}, {info.dtype}, max model len {info.max_model_len}, "
        f"{info.shape_policy} shapes, {info.kv_blocks_total} KV blocks of {info.block_size} per worker",
        f"  workers     {workers} ({config.mode}{transfer})",
        f"  OpenAI API  {base}/v1  (completions, chat/completions, models)",
        f"  health      {base}/health",
        f"  metrics     {base}/metrics",
        f"  dashboard   {base}/dashboard",
        "Ctrl-C to stop.",
    ]


def _quiet_ray_driver() -> None:
    """Ray's and Serve's own INFO chatter in this process (they log at WARNING and above from here on)."""
    for name in ("ray", "ray.serve"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # The token-authentication notice of a local cluster this process starts and owns.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


class _StartUpSignals:
    """SIGINT and SIGTERM during start-up interrupt it (KeyboardInterrupt), remembering which came."""

    def __init__(self) -> None:
        self.received = signal.SIGINT
        self._held = False
        # Set by every signal, raised or held: a KeyboardInterrupt raised at an unlucky moment is swallowed (inside
        # a __del__ or weakref callback run by the garbage collector, Python prints it as "ignored"), so start-up
        # also checks this flag between its phases instead of trusting the raise alone.
        self._pending = False

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._interrupt)

    def _interrupt(self, signum: int, _frame: Any) -> None:
        self.received = signal.Signals(signum)
        self._pending = True
        if not self._held:
            raise KeyboardInterrupt

    @property
    def pending(self) -> bool:
        return self._pending

    def check(self) -> None:
        """Between phases: a signal that came, even one whose interrupt was swallowed, interrupts here."""
        if self._pending:
            raise KeyboardInterrupt

    def hand_over(self, handler: Callable[[int, Any], None]) -> None:
        """Start-up is over: ``handler`` takes SIGINT and SIGTERM from now on; a signal that came before it did
        still counts as one during start-up."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, handler)
        self.check()

    @contextlib.contextmanager
    def held_while_ray_starts(self) -> Iterator[None]:
        """While Ray is imported and ``ray.init`` runs, a signal is noted and acted on once they are done: raised
        inside them, the interrupt can leave a module half imported or Ray half started, or be swallowed (by a
        fork handler: the server then starts anyway). ``ray.init`` also puts its own SIGTERM handler in place
        (exit at once), kept out here."""
        self._held = True
        try:
            import ray._private.utils as ray_utils

            original = getattr(ray_utils, "set_sigterm_handler", None)
            if original is not None:
                ray_utils.set_sigterm_handler = lambda handler: None
            try:
                yield
            finally:
                if original is not None:
                    ray_utils.set_sigterm_handler = original
        finally:
            self._held = False
            # Ray's crash reporter took SIGTERM over at the C level (it dumps a stack, then calls our handler).
            self.install()
        if self._pending:
            raise KeyboardInterrupt

    def interrupted(
        self,
        handles=None,
        gateway: threading.Thread | None = None,
        ray_started: bool = True,
        joined_cluster: bool = False,
    ) -> int:
        """Undo what started; the exit code a shell gives a process ended by the signal (130, 143)."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal must not interrupt the clean-up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"interrupted during start-up ({self.received.name})", file=sys.stderr, flush=True)
        # CPython notes a KeyboardInterrupt that escaped code run by exec() of a string (dataclasses make their
        # methods so, at import) as never handled, and under `python -m` then ends the process with SIGINT at exit
        # instead of with our exit code; the next such exec() clears the note.
        exec("None")
        if gateway is not None:
            # Its Serve calls end before Ray goes: one made after ray.shutdown() would start a new Ray here.
            gateway.join(timeout=60)
        if ray_started:
            _shutdown(handles, drain=False, joined_cluster=joined_cluster)
        return 128 + self.received


class ServePortTaken(RuntimeError):
    """Ray Serve already runs on the cluster with its proxy on another port: ours would never listen on --port."""


def _check_serve_port(port: int) -> None:
    """On a cluster joined with ``--address``, Ray Serve may already run for other applications: it keeps its own
    HTTP options and would ignore ours, so the gateway would answer on its port, not on --port. Said before any
    worker starts."""
    from ray import serve
    from ray.serve.context import _get_global_client

    try:
        client = _get_global_client(raise_if_no_controller_running=False)
    except Exception as e:  # an older or newer Serve without it: serve.start's own warning remains
        logger.debug("no Serve client to check the port against: %s", e)
        return
    if client is None or client.http_config.port == port:
        return
    apps = sorted(serve.status().applications)
    if not apps:  # left running with nothing on it: restarted below on our port
        logger.info(
            "restarting the idle Ray Serve of this cluster (its proxy was on port %d)",
            client.http_config.port,
        )
        serve.shutdown()
        return
    raise ServePortTaken(
        f"Ray Serve already runs on this cluster with its HTTP proxy on port {client.http_config.port} "
        f"(applications: {', '.join(apps)}); it would ignore --port {port}. Serve on --port "
        f"{client.http_config.port}, or stop that Serve instance first (`serve shutdown`)"
    )


def _release_serve_if_unused() -> None:
    """On a Ray cluster this process joined (``--address``), Serve (controller and proxies) outlives it: left
    running, its proxy keeps holding --port, and a later serve on the same cluster with another --port would get
    the old one (Serve ignores new HTTP options while it runs). Shut it down when no other application uses it
    (ours may still be listed while a non-blocking delete runs); a cluster started here goes down with Ray."""
    from ray import serve

    others = sorted(set(serve.status().applications) - {"bucketserve"})
    if others:
        logger.info("Ray Serve keeps running for other applications: %s", ", ".join(others))
        return
    serve.shutdown()


def _wait_for_gateway(name: str, timeout_s: float) -> None:
    """Wait for the gateway app to be RUNNING, as ``serve.run`` does, but in the main thread, where a signal can
    interrupt the wait."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(name)
        if app is not None and app.status == "RUNNING":
            return
        if app is not None and app.status == "DEPLOY_FAILED":
            raise RuntimeError(f"the gateway failed to deploy: {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway was not running after {timeout_s:.0f}s")
        time.sleep(0.2)


class _KernelPrebuild:
    """Compiles the engine's CPU kernels not yet in the cache (``engine.kernels.build.prebuild``) in a thread,
    where the workers will run on this machine's CPU, while Ray starts. From an empty cache on a 2-core Xeon, the
    four took 45-49 s side by side against the workers' 76 s building them in turn. torch is imported in the
    thread, so the flag check and Ray's start never wait for it. ``close`` stops it and waits for the thread:
    a thread still importing torch or logging when the interpreter finalises aborts the process (SIGABRT on the
    stderr lock) instead of letting it exit with its status."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, device: str) -> None:
        """Start compiling, unless the device is named and is not the CPU."""
        if device not in ("cpu", "auto"):
            return

        def prebuild() -> None:
            import importlib.util

            import torch

            accelerator = (
                torch.cuda.is_available() or importlib.util.find_spec("habana_frameworks") is not None
            )
            if self._stop.is_set() or (device == "auto" and accelerator):
                return
            from engine.kernels.build import prebuild as build_missing

            build_missing(self._stop)

        self._thread = threading.Thread(target=prebuild, name="kernel-prebuild", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait until the kernels are built (the workers load them next)."""
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Stop compiling and wait for the thread to end (at most the rest of torch's import)."""
        self._stop.set()
        self.wait()


def run(args: argparse.Namespace) -> int:
    kernels = _KernelPrebuild()
    try:
        return _run(args, kernels)
    finally:
        kernels.close()


def _run(args: argparse.Namespace, kernels: _KernelPrebuild) -> int:
    from gateway.flags import FlagError, check_port_free
    from gateway.ray_network import is_loopback, warn_if_open_http

    debug = getattr(args, "log_level", "INFO") == "DEBUG"
    t0 = time.perf_counter()
    # Ctrl-C or SIGTERM during start-up interrupts it (Ctrl-C also when the shell started this process with
    # SIGINT ignored, a background job, which would otherwise make it deaf to SIGINT until it serves).
    start_up = _StartUpSignals()
    start_up.install()
    try:
        args = resolve_settings(args, getattr(args, "command_argv", None))
        config, facts = checked_cluster_config(args, quiet=not debug)
        check_port_free(args.host, args.port)
        warn_if_open_http(args.host, api_key(args))
        start_up.check()
        # The CPU kernels compile (first start only) while Ray starts, side by side, not in each worker in turn.
        kernels.start(config.engine.device)
        start_up.check()
    except FlagError as e:
        if start_up.pending:  # the signal's doing (an import it cut short), not the user's mistake
            return start_up.interrupted(ray_started=False)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return start_up.interrupted(ray_started=False)
    handles = None
    gateway: threading.Thread | None = None
    joined_cluster = config.ray_address is not None
    stop = threading.Event()
    force = threading.Event()

    def on_signal(*_: Any) -> None:
        (force if stop.is_set() else stop).set()

    from gateway import direct_ingress

    direct = direct_ingress.wanted(args.direct_ingress, args.address, args.gateway_replicas)
    # Before Ray starts (its processes inherit the settings) and before Serve is imported here.
    proxy_port = direct_ingress.enable(args.host, args.port) if direct else args.port
    try:
        with start_up.held_while_ray_starts():
            from ray import serve

            from gateway import drain_signal
            from gateway.cluster_launch import ensure_ray, launch_cluster

            if not debug:
                _quiet_ray_driver()
            ensure_ray(config)
        if joined_cluster:
            _check_serve_port(proxy_port)
        # Before the gateway replicas, which follow it from their start (the drain on SIGTERM or Ctrl-C).
        signal_name = config.actor_name("drain-signal")
        drainer = drain_signal.launch(signal_name, config.namespace)
        logger.info(
            "loading %s (%s, %s) and warming up %d worker(s)...",
            config.engine.model,
            facts.architecture,
            config.engine.dtype,
            len(config.worker_ids()),
        )
        # Ray Serve and the gateway replica start while the workers load and warm up (the replica connects to
        # the cluster and waits for it), so the two start-ups overlap instead of adding up.
        gateway_failed: list[BaseException] = []

        def start_gateway() -> None:
            try:
                serve.start(
                    # A proxy bound to loopback answers only on its own node: one, on the head, is all that can be
                    # reached (two nodes of one machine would also fight over the port).
                    proxy_location="HeadOnly" if is_loopback(args.host) else "EveryNode",
                    # With direct ingress the replica holds --port and the proxy listens where nobody calls.
                    http_options={"host": args.host, "port": proxy_port},
                    logging_config={"log_level": "DEBUG" if debug else "WARNING"},
                )
                app = _gateway_app(config, args, (config.namespace, signal_name))
                # Deployed without waiting for it to run: the main thread waits (_wait_for_gateway).
                serve.run_many(
                    [serve.RunTarget(app, name="bucketserve", route_prefix="/")],
                    wait_for_ingress_deployment_creation=False,
                    wait_for_applications_running=False,
                )
            except BaseException as e:  # re-raised in the main thread
                gateway_failed.append(e)

        start_up.check()
        gateway = threading.Thread(target=start_gateway, name="gateway-start", daemon=True)
        gateway.start()
        kernels.wait()
        handles = launch_cluster(config)
        start_up.check()
        gateway.join()
        if gateway_failed:
            raise gateway_failed[0]
        _wait_for_gateway("bucketserve", config.startup_timeout_s)
        if direct:
            direct_ingress.check_listening(args.host, args.port)
        # The first SIGTERM or Ctrl-C from here on drains the gateway, a second one stops at once.
        start_up.hand_over(on_signal)
    except KeyboardInterrupt:
        return start_up.interrupted(handles, gateway, joined_cluster=joined_cluster)
    except Exception as e:
        if start_up.pending:  # a failure the signal caused (a wait or an import it cut short)
            return start_up.interrupted(handles, gateway, joined_cluster=joined_cluster)
        logger.debug("start-up failed", exc_info=True)
        print(f"error: start-up failed: {_one_line(e)}", file=sys.stderr, flush=True)
        if not debug:
            print("  (--log-level DEBUG shows the full traceback)", file=sys.stderr, flush=True)
        if gateway is not None:
            # Its Serve calls end before Ray goes: a thread still inside Ray's client when the interpreter exits
            # is torn down mid-call, and the process aborts ("exception not rethrown") instead of exiting 1.
            gateway.join(timeout=60)
        _shutdown(handles, drain=False, joined_cluster=joined_cluster)
        return 1
    try:
        for line in _banner(handles, args, time.perf_counter() - t0):
            print(line, flush=True)
        while not stop.wait(1.0):
            pass
        print(
            f"draining: new requests get 503, open ones have up to {args.drain_timeout_s:g}s to finish "
            "(Ctrl-C again to stop at once)",
            flush=True,
        )
        try:
            print(drain_signal.drain_replicas(drainer, args.drain_timeout_s, force), flush=True)
        except Exception as e:
            print(f"drain failed ({_one_line(e)}); stopping anyway", flush=True)
    finally:
        print("stopping...", flush=True)
        _shutdown(handles, drain=not force.is_set(), joined_cluster=joined_cluster)
        print("stopped.", flush=True)
    return 0


def _shutdown(handles, drain: bool = True, joined_cluster: bool = False) -> None:
    """Gateway first (open streams end; ``drain=False``: do not wait for it, a replica may still be starting),
    then the cluster's actors, then Ray."""
    import ray
    from ray import serve

    from gateway.cluster_launch import stop_cluster

    try:
        if ray.is_initialized():
            # Deleting the app drains its replicas; serve.shutdown() would also kill Serve's controller
            # while its own graceful-shutdown task runs, which Ray reports as a failed task.
            serve.delete("bucketserve", _blocking=drain)
            if joined_cluster:
                _release_serve_if_unused()
    except Exception as e:  # not deployed yet, or Ray already going down
        logger.debug("serve delete: %s", e)
    try:
        if handles is not None:
            stop_cluster(handles)
    finally:
        ray.shutdown()
