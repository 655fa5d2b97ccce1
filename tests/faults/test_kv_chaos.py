"""KV chunks damaged in the running cluster: every 16th chunk a prefill worker sends is corrupted, or never sent.
The receiver catches each (checksum, missing chunk), the transfer is sent again or the request prefilled again,
and every request still completes, token for token, with no block leaked. Real Ray actors, gRPC and model."""

from __future__ import annotations

import asyncio

import pytest
import ray
from cluster_helpers import (
    NUM_BLOCKS,
    assert_all_equal_hf,
    cluster_config,
    collect,
    make_request,
    wait_idle,
)

from gateway.cluster_backend import RayClusterBackend
from kv_transfer import FaultInjector

pytestmark = pytest.mark.slow

EVERY = 16


@pytest.mark.parametrize("fault", ["corrupt", "drop"])
def test_every_16th_kv_chunk_damaged_and_every_request_still_exact(ray_session, hf_reference, fault):
    faults = FaultInjector(**{f"{fault}_every": EVERY})
    backend = RayClusterBackend(cluster_config("disaggregated", f"chaos-{fault}", kv_faults=faults))
    try:
        reqs = [make_request(f"chaos-{fault}{i}", 20 + 23 * i, 16, seed=17) for i in range(12)]

        async def run():
            return await asyncio.wait_for(asyncio.gather(*(collect(backend, r) for r in reqs)), 240)

        results = asyncio.run(run())
        assert_all_equal_hf(results, reqs, hf_reference("tiny", "cpu"))
        stats = asyncio.run(wait_idle(backend, 30))
        sent = stats[backend.config.actor_name("prefill", 0)]["transport"]
        print(f"{fault} every {EVERY}th chunk: {sent}")
        # The faults did happen: transfers were sent again, or failed and their requests prefilled again.
        assert sent["retries"] + sent["transfers_failed"] >= 1, sent
        for name, s in stats.items():
            assert s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == NUM_BLOCKS, (name, s)
            assert s["integrity_error"] is None, (name, s)
        state = ray.get(backend.handles.controller.state.remote())
        assert state["in_cluster"] == 0 and all(w["reserved"] == 0 for w in state["decode"].values()), state
    finally:
        asyncio.run(backend.shutdown())
