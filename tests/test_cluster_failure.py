"""A worker that dies mid-decode: the requests it held end promptly in a clear error, the others complete, new
requests are served by the survivors, and nothing leaks. Real Ray actors killed with ``ray.kill``."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from cluster_helpers import cluster_config, collect, gather_all, make_request

from gateway.cluster_backend import RayClusterBackend

pytestmark = pytest.mark.slow

# How long after the kill every request must have ended (the gateway notices at its next drain call).
PROMPT_END_S = 5.0
# The mid-decode test's requests: 30 + 450 tokens, 30 blocks each, two per worker. Long enough that all four are
# still decoding together after the last one's hand-off even on a fast host (with 150 tokens out, a 2-core EPYC
# finished the first before the fourth arrived, and the wait for all four running timed out).
DECODE_TOKENS = 450
DIE_BLOCKS = 96


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_worker_killed_mid_decode_ends_its_requests_with_an_error(ray_session, mode, hf_reference):
    two = {"decode_workers": 2} if mode == "disaggregated" else {"colocated_workers": 2}
    backend = RayClusterBackend(cluster_config(mode, f"die-{mode}", num_blocks=DIE_BLOCKS, **two))
    role = "decode" if mode == "disaggregated" else "colocated"
    victim = backend.config.actor_name(role, 0)
    try:
        # 4 x 30 blocks: spread over both workers (the emptier one is chosen), all running at once.
        reqs = [make_request(f"{mode}-die{i}", 30, DECODE_TOKENS, seed=5) for i in range(4)]

        async def run():
            tasks = [asyncio.ensure_future(collect(backend, r)) for r in reqs]
            # Wait until every request is decoding (has streamed tokens), then kill one worker.
            deadline = time.monotonic() + 30
            while True:
                stats = await backend.worker_stats()
                running = sum(s["running"] for n, s in stats.items() if n.split(":")[1].startswith(role))
                if running == len(reqs):
                    break
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.02)
            ray.kill(backend.handles.workers[victim][1])
            killed_at = time.monotonic()
            done = await gather_all(backend, tasks, PROMPT_END_S + 30)
            return killed_at, done

        killed_at, results = asyncio.run(run())
        failed = [g for g in results if g.error is not None]
        finished = [g for g in results if g.error is None]
        assert failed, "the killed worker held no request"
        assert finished, "the surviving worker held no request"
        for g in failed:
            assert g.finish_reason == "error" and victim in g.error, g.error
            assert g.finished_at - killed_at < PROMPT_END_S, (
                f"{g.request_id} ended {g.finished_at - killed_at:.1f}s late"
            )
        by_id = {r.request_id: r for r in reqs}
        for g in finished:
            req = by_id[g.request_id]
            assert g.tokens == hf_reference("tiny", "cpu").greedy(
                req.prompt_token_ids, DECODE_TOKENS, ignore_eos=True
            ), g.request_id

        async def after():
            # The survivors serve new work; the dead worker is never chosen again.
            new = await collect(backend, make_request(f"{mode}-after", 40, 8, seed=6))
            health = await backend.health()
            stats = await asyncio.wait_for(_survivor_stats(backend, victim), 30)
            return new, health, stats

        new, health, stats = asyncio.run(after())
        assert new.error is None and len(new.tokens) == 8
        assert health["ready"] is False
        assert {w["id"] for w in health["workers"] if not w["up"]} == {victim}
        for name, s in stats.items():
            assert s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == DIE_BLOCKS, (name, s)
            assert s["integrity_error"] is None
        if backend.handles.controller is not None:
            state = ray.get(backend.handles.controller.state.remote())
            assert state["in_cluster"] == 0 and state["queued"] == 0, state
            assert state["decode"][victim]["alive"] is False
            assert all(d["reserved"] == 0 for d in state["decode"].values()), state
    finally:
        asyncio.run(backend.shutdown())


async def _survivor_stats(backend: RayClusterBackend, victim: str) -> dict[str, dict]:
    """KV figures of the living workers once they hold no block."""
    alive = {n: h for n, (_, h) in backend.handles.workers.items() if n != victim}
    while True:
        stats = dict(
            zip(alive, await asyncio.gather(*(h.stats.remote() for h in alive.values())), strict=True)
        )
        if all(s["kv_blocks_used"] == 0 for s in stats.values()):
            return stats
        await asyncio.sleep(0.1)


def test_prefill_worker_killed_with_batches_in_flight_ends_them_and_leaks_nothing(ray_session, hf_reference):
    backend = RayClusterBackend(cluster_config("disaggregated", "die-prefill", prefill_workers=2))
    victim = backend.config.actor_name("prefill", 0)
    try:
        # Long prompts keep batches on the prefill workers long enough to be caught in flight.
        reqs = [make_request(f"pdie{i}", 400, 20, seed=7 + i) for i in range(8)]

        async def run():
            tasks = [asyncio.ensure_future(collect(backend, r)) for r in reqs]
            deadline = time.monotonic() + 30
            while True:
                state = await backend.handles.controller.state.remote()
                if state["prefill"][victim]["outstanding"] > 0:
                    break
                assert time.monotonic() < deadline and not all(t.done() for t in tasks), state
                await asyncio.sleep(0.005)
            ray.kill(backend.handles.workers[victim][1])
            killed_at = time.monotonic()
            return killed_at, await gather_all(backend, tasks, PROMPT_END_S + 30)

        killed_at, results = asyncio.run(run())
        by_id = {r.request_id: r for r in reqs}
        for g in results:
            # Every request ends: a complete, exact answer, or a prompt error naming the dead worker.
            if g.error is None:
                assert g.tokens == hf_reference("tiny", "cpu").greedy(
                    by_id[g.request_id].prompt_token_ids, 20, ignore_eos=True
                ), g.request_id
            else:
                assert g.finish_reason == "error" and victim in g.error, g.error
                assert g.finished_at - killed_at < PROMPT_END_S, f"{g.request_id} ended late"
        assert any(g.error is not None for g in results), "no request was in flight on the killed worker"
        stats = asyncio.run(asyncio.wait_for(_survivor_stats(backend, victim), 30))
        for name, s in stats.items():
            assert s["kv_blocks_used"] == 0 and s["integrity_error"] is None, (name, s)
        state = ray.get(backend.handles.controller.state.remote())
        assert state["in_cluster"] == 0 and state["queued"] == 0, state
        assert all(d["reserved"] == 0 for d in state["decode"].values()), state
    finally:
        asyncio.run(backend.shutdown())
