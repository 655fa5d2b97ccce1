"""A gateway replica whose cluster was replaced (stopped and launched again under the same names, as a redeploy
does) fails Ray Serve's health check, so Serve replaces it, and the new replica connects to the running cluster:
the API answers again without anyone restarting the gateway. Real Ray Serve, actors and model."""

from __future__ import annotations

import asyncio
import functools
import time

import httpx
import pytest
from cluster_helpers import cluster_config

from bench.server_process import free_port
from gateway.app import build_app
from gateway.cluster_backend import RayClusterBackend
from gateway.commands.serve import connect_backend
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.slow

BODY = {"prompt": [11, 12, 13, 14], "max_tokens": 4, "ignore_eos": True}


def test_a_replica_whose_cluster_was_replaced_is_replaced_and_reconnects(ray_session) -> None:
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = cluster_config("disaggregated", "reconnect")
    launcher = RayClusterBackend(config)
    url = f"http://127.0.0.1:{port}/reconnect"
    try:
        app = build_app(
            GatewaySettings(backend_factory=functools.partial(connect_backend, config)),
            ray_actor_options={"num_cpus": 0},
            name="gw-reconnect",
            health_check_period_s=1.0,
            health_check_timeout_s=10.0,
        )
        serve.run(app, name="reconnect", route_prefix="/reconnect")
        assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).status_code == 200
        # The cluster is stopped and launched again: same names, new actors.
        asyncio.run(launcher.shutdown())
        launcher = RayClusterBackend(config)
        replaced_at = time.monotonic()
        deadline = replaced_at + 90
        while True:
            try:
                r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway never reconnected to the new cluster"
            time.sleep(0.5)
        print(
            f"the gateway answered again {time.monotonic() - replaced_at:.1f} s after the cluster was replaced"
        )
        assert r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    finally:
        serve.delete("reconnect")
        asyncio.run(launcher.shutdown())
        serve.shutdown()
