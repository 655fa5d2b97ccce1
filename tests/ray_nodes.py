"""Real Ray nodes for tests: ``ray start --block`` on free ports, each in its own process session, so that
stopping it stops only what the test started. Two nodes on one machine take two loopback addresses."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import time
from pathlib import Path

from bench.server_process import REPO_ROOT, ServerProcess, free_port

BIN = Path(sys.executable).parent


def tail(path: Path, n: int = 1500) -> str:
    with contextlib.suppress(OSError):
        return path.read_bytes()[-n:].decode(errors="replace")
    return ""


def cluster_env() -> dict[str, str]:
    """The environment of every node and client of one test cluster."""
    paths = [str(REPO_ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return {
        # The cluster's processes import the code from this checkout, as every node must have it installed.
        "PYTHONPATH": os.pathsep.join(p for p in dict.fromkeys(paths) if p),
        # Ray 2.60 turns token auth on for `ray start` wherever ~/.ray/auth_token exists: one token of our own for
        # every node and client keeps the test independent of that file (and a second node must present it).
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def wait_for_line(server: ServerProcess, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in server.log_tail(100_000):
        if not server.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"no {text!r} from {server.log_path.name}: {server.log_tail()}")
        time.sleep(0.2)


def _distinct_free_ports(n: int, taken: tuple[int, ...] = ()) -> list[int]:
    """``n`` free ports, no two alike and none in ``taken`` (the head's GCS port, asked for earlier): the OS may
    hand a port just released back to the next ask, and Ray refuses a port given to two of its components."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports and port not in taken:
            ports.append(port)
    return ports


def start_node(
    env: dict[str, str],
    ray_tmp: Path,
    log: Path,
    *,
    head_port: int | None = None,
    address: str | None = None,
    node_ip: str = "127.0.0.1",
    num_cpus: int = 2,
    resources: dict[str, float] | None = None,
) -> ServerProcess:
    """A head (``head_port``) or a node joining ``address``, on ``node_ip``, every port of its own free; returns
    once it is up. Stop it with :func:`stop_node`."""
    flags = [
        "--node-manager-port",
        "--object-manager-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
        "--metrics-export-port",
    ]
    cmd = [str(BIN / "ray"), "start", "--block", "--num-cpus", str(num_cpus), "--node-ip-address", node_ip]
    cmd += ["--disable-usage-stats", "--temp-dir", str(ray_tmp)]
    # Worker processes on ports the OS picks: Ray's default range (10002-19999) is shared with other clusters.
    cmd += ["--min-worker-port", "0", "--max-worker-port", "0"]
    if head_port is not None:
        cmd += ["--head", "--port", str(head_port), "--include-dashboard", "false"]
        # Without the dashboard Ray still starts a dashboard process, on 8265 unless told.
        flags += ["--dashboard-port", "--ray-client-server-port"]
    else:
        cmd += ["--address", str(address)]
    if resources:
        cmd += ["--resources", json.dumps(resources)]
    taken = (head_port,) if head_port is not None else ()
    for flag, value in zip(flags, _distinct_free_ports(len(flags), taken), strict=True):
        cmd += [flag, str(value)]
    node = ServerProcess(cmd, env, log)
    try:
        wait_for_line(node, "block forever", 120)
    except BaseException:
        stop_node(node)
        raise
    return node


def stop_node(node: ServerProcess) -> None:
    node.proc.terminate()  # `ray start --block` stops the processes it started on SIGTERM
    node.stop(grace_s=30)  # and this whatever of its session is left
