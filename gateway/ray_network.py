"""Where Ray and the HTTP gateway listen, and the warnings when that is beyond this machine.

A local Ray cluster (``bucketserve serve`` without ``--address``) runs on loopback: its node address is
127.0.0.1, so the GCS, the raylet, the agents and every worker listen there only. Ray's own address detection
picks the machine's network address instead (a node others could join), and turns an explicit 127.0.0.1 into
that address too, unless Ray is told the cluster is a single machine's (its ``ENABLE_RAY_CLUSTER`` switch,
what ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` sets): ``local_ray_init`` holds that switch off while the node
starts. Joining a cluster that spans hosts (``--address``) without Ray's token authentication, or serving HTTP
beyond loopback without an API key, gets a one-line warning. Ray Serve binds each replica's own server to every
interface; ``keep_serve_replica_on_loopback`` keeps the gateway replica's on loopback in a loopback cluster.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) reaches this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


@contextlib.contextmanager
def _single_machine_cluster() -> Iterator[None]:
    """Ray's switch for a cluster of this machine alone, on while a node starts: its node address is loopback."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def local_ray_init(**kwargs: Any) -> None:
    """``ray.init`` of a new local cluster whose every process listens on 127.0.0.1 only."""
    import ray

    with _single_machine_cluster():
        ray.init(_node_ip_address=LOOPBACK, dashboard_host=LOOPBACK, **kwargs)
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:  # a Ray whose switch works differently
        logger.warning("the local Ray cluster listens on %s, not on loopback only", node_ip)


def keep_serve_replica_on_loopback() -> None:
    """In a Ray Serve replica of a loopback cluster: its server for calls from Serve's proxy and other deployments
    listens on 127.0.0.1 too (Serve binds it to every interface, whatever the node's address). Called in the
    replica's constructor, before Serve starts that server."""
    import ray

    if ray.util.get_node_ip_address() != LOOPBACK:
        return
    from ray.serve._private import replica

    bind = replica.add_port_to_grpc_server
    if getattr(bind, "loopback_only", False):
        return

    def bind_on_loopback(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        return bind(server, f"{LOOPBACK}:{port}" if host in ("[::]", "0.0.0.0", "") else address)

    bind_on_loopback.loopback_only = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = bind_on_loopback


def token_auth_enabled() -> bool:
    """Whether this process talks to Ray with token authentication (``RAY_AUTH_MODE=token``)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication
        return False
    return bool(is_token_auth_enabled())


def warn_unless_token_auth(address: str) -> None:
    """A cluster joined at ``address`` may span hosts: say so when nothing authenticates its callers."""
    if not token_auth_enabled():
        logger.warning(
            "Ray cluster %s runs without token authentication: anyone who reaches its ports can run code "
            "there (set RAY_AUTH_MODE=token and a token on every node)",
            address,
        )


def warn_if_open_http(host: str, api_key: str | None) -> None:
    """The HTTP gateway listening beyond loopback with no API key serves anyone who reaches it."""
    if not is_loopback(host) and not api_key:
        logger.warning(
            "the HTTP gateway listens on %s without an API key: anyone who reaches it can use the API "
            "(give --api-key)",
            host,
        )
