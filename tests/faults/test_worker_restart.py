"""A worker whose process dies is re-created by Ray from its config and rejoins: what it held ends with an error
naming it, and once it is back it is planned for again (a restarted decode worker listens on a new KV address,
which the prefill workers learn; a restarted prefill worker learns the decode workers'), so new requests are
served exactly and the cluster is whole again. Real Ray actors, killed as a crash would."""

from __future__ import annotations

import asyncio
import time

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

pytestmark = pytest.mark.slow

BACK_S = 60.0  # from the kill to serving again (the worker loads the model again)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_killed_worker_restarts_and_rejoins(ray_session, hf_reference, role):
    backend = RayClusterBackend(cluster_config("disaggregated", f"restart-{role}"))
    victim = backend.config.actor_name(role, 0)
    handle = backend.handles.workers[victim].handle
    reference = hf_reference("tiny", "cpu")
    try:
        req = make_request(f"restart-{role}-0", 30, 300, seed=18)

        async def run():
            started = asyncio.Event()
            task = asyncio.ensure_future(collect(backend, req, started))
            await asyncio.wait_for(started.wait(), 60)
            ray.kill(handle, no_restart=False)  # the process dies; Ray may re-create the actor
            killed_at = time.monotonic()
            lost = await asyncio.wait_for(task, 30)
            # Back: a new request completes, exactly.
            while True:
                health = await backend.health()
                if health["ready"]:
                    break
                assert time.monotonic() - killed_at < BACK_S, health
                await asyncio.sleep(0.5)
            back_s = time.monotonic() - killed_at
            reqs = [make_request(f"restart-{role}-after{i}", 20 + 10 * i, 12, seed=19) for i in range(4)]
            after = await asyncio.wait_for(asyncio.gather(*(collect(backend, r) for r in reqs)), 120)
            return killed_at, lost, back_s, reqs, after

        killed_at, lost, back_s, reqs, after = asyncio.run(run())
        print(f"{role} worker back {back_s:.1f} s after the kill")
        # The running request: its KV died with a decode worker, so it ends with an error naming it; with the
        # only prefill worker dead every request in the cluster is given up the same way (none could be placed),
        # unless it had already reached its decode worker and finished.
        if role == "decode" or lost.error is not None:
            assert lost.finish_reason == "error" and victim in (lost.error or ""), lost
            assert lost.finished_at - killed_at < 5.0
        else:
            assert len(lost.tokens) == 300 and lost.tokens == reference.greedy(
                req.prompt_token_ids, 300, ignore_eos=True
            )
        assert_all_equal_hf(after, reqs, reference)
        stats = asyncio.run(wait_idle(backend, 30))
        for name, s in stats.items():
            assert s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == NUM_BLOCKS, (name, s)
        state = ray.get(backend.handles.controller.state.remote())
        assert state["in_cluster"] == 0, state
        assert all(
            w["alive"] and w["reserved"] == 0 for pool in ("prefill", "decode") for w in state[pool].values()
        )
    finally:
        asyncio.run(backend.shutdown())
