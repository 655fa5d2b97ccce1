"""Ray Serve's direct ingress for ``bucketserve serve --direct-ingress``: the gateway replica answers HTTP on
the user's port itself, instead of behind Serve's proxy.

Behind the proxy every request and every streamed chunk takes one more process hop (client -> proxy -> replica
and back), and the replica reads the request body from the proxy over Ray: on a 2-core machine that hop cost a
streamed completion 8-17 ms of its time to first token (the same server, both ways, alternating). Serve (as of
the pinned 2.60) can start an HTTP server inside each ingress replica, on a port its controller hands out from a
range set by environment variables read when Serve's processes start; Serve still starts its proxy, which is
moved to a free port that nothing needs to call.

What it asks for, checked at start-up: a Ray cluster started here (the variables reach Serve's controller and
replicas only through the processes this one starts) and one gateway replica (only one replica can hold the port).
"""

from __future__ import annotations

import os
import socket

# Read by Ray Serve (ray.serve._private.constants) at import, in its controller and replicas.
ENABLE = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
MIN_HTTP_PORT = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"
MAX_HTTP_PORT = "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"  # exclusive: the ports are range(MIN, MAX)
MIN_DRAINING_PERIOD = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


MODES = ("auto", "on", "off")


def check(address: str | None, gateway_replicas: int) -> str | None:
    """What makes direct ingress impossible with these flags, in flag terms; None when nothing does."""
    if address is not None:
        return (
            f"--direct-ingress on cannot join a running cluster (--address {address}): Serve reads the setting "
            "from the environment its processes start with; leave --address out"
        )
    if gateway_replicas != 1:
        return f"--direct-ingress on serves one gateway replica on --port, got --gateway-replicas {gateway_replicas}"
    return None


def wanted(mode: str, address: str | None, gateway_replicas: int) -> bool:
    """Whether serve runs the gateway with direct ingress: ``on`` always (``check`` has passed), ``auto`` where
    it can (a cluster started here, one gateway replica), ``off`` never."""
    return mode == "on" or (mode == "auto" and check(address, gateway_replicas) is None)


def environment(port: int) -> dict[str, str]:
    """The variables that make Serve's ingress replica listen on ``port``, and on no other."""
    return {
        ENABLE: "1",
        MIN_HTTP_PORT: str(port),
        MAX_HTTP_PORT: str(port + 1),
        # Serve's own drain keeps a stopping replica's port open this long (30 s by default) for a load balancer
        # to notice; serve's drain (503 on /health and new requests, open streams run out) comes first already.
        MIN_DRAINING_PERIOD: "0",
    }


def enable(host: str, port: int) -> int:
    """Set the variables for the processes Ray starts from here on (call before ``ray.init``); returns a free
    port on ``host`` for Serve's proxy, which must listen somewhere other than ``port``."""
    os.environ.update(environment(port))
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_listening(host: str, port: int) -> None:
    """Raise unless the gateway replica accepts connections on ``port`` (Serve takes another port of its range
    when this one is taken; the range holds this one alone, so a failure shows here rather than as a server on a
    port nobody was told of)."""
    target = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    try:
        with socket.create_connection((target, port), timeout=5.0):
            return
    except OSError as e:
        raise RuntimeError(f"the gateway replica is not listening on {host}:{port} ({e})") from None
