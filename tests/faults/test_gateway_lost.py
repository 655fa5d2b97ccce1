"""A gateway replica that dies with a request in flight leaks nothing: the decode worker ends the request and
releases the controller's reservation itself (no gateway is left to do it). Real Ray actors; the lost gateway
is a real backend inside a Ray actor that is killed."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from cluster_helpers import NUM_BLOCKS, cluster_config, make_request, wait_idle

from gateway.cluster_backend import RayClusterBackend

pytestmark = pytest.mark.slow


def test_a_gateway_that_dies_mid_stream_leaves_no_reservation_or_block(ray_session):
    backend = RayClusterBackend(cluster_config("disaggregated", "gw-lost"))
    controller = backend.handles.controller

    # Defined here so Ray ships the class by value to its worker process.
    @ray.remote(num_cpus=0)
    class DoomedGateway:
        def __init__(self, config) -> None:
            self.backend = RayClusterBackend(config, launch=False)
            self.tokens = 0

        async def start(self, req) -> int:
            first = asyncio.Event()

            async def run() -> None:
                async for out in self.backend.generate(req):
                    self.tokens += len(out.new_token_ids)
                    first.set()

            self.task = asyncio.ensure_future(run())
            await asyncio.wait_for(first.wait(), 60)
            return self.tokens

    try:
        doomed = DoomedGateway.remote(backend.config)
        assert ray.get(doomed.start.remote(make_request("lost0", 40, 120, seed=16)), timeout=120) >= 1
        assert ray.get(controller.state.remote())["in_cluster"] == 1
        ray.kill(doomed)

        async def settled() -> tuple[dict, dict]:
            deadline = time.monotonic() + 60
            while True:
                state = await controller.state.remote()
                stats = await wait_idle(backend, 1.0)
                idle = all(s["kv_blocks_used"] == 0 for s in stats.values())
                if idle and state["in_cluster"] == 0:
                    return state, stats
                assert time.monotonic() < deadline, (state, stats)
                await asyncio.sleep(0.2)

        state, stats = asyncio.run(settled())
        assert all(w["reserved"] == 0 for w in state["decode"].values()), state
        assert all(w["reserved"] == 0 and w["outstanding"] == 0 for w in state["prefill"].values()), state
        for name, s in stats.items():
            assert s["kv_blocks_free"] == NUM_BLOCKS and s["integrity_error"] is None, (name, s)
    finally:
        asyncio.run(backend.shutdown())
