"""The controller dies under load: Ray brings it back from its config, it rebuilds its ledger from the workers,
the gateway sends again what its queue held, and every request still completes, token for token; nothing leaks.
And with two gateways on one cluster, a decode or a prefill worker's death ends the requests of both. Real Ray actors, real model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
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

# From the kill to a rebuilt controller answering again.
REBUILD_S = 10.0


def test_controller_killed_under_load_comes_back_and_every_request_completes(ray_session, hf_reference):
    backend = RayClusterBackend(cluster_config("disaggregated", "ctl-restart"))
    controller = backend.handles.controller
    try:
        # 10 requests of 8 blocks each against a 48-block decode cache: most wait in the controller's queue.
        reqs = [make_request(f"ctl{i}", 60, 60, seed=11) for i in range(10)]
        before = ray.get(controller.state.remote())["incarnation"]

        async def run():
            tasks = [asyncio.ensure_future(collect(backend, r)) for r in reqs]
            deadline = time.monotonic() + 60
            while True:  # some decoding, some still queued in the controller
                state = await controller.state.remote()
                stats = await backend.worker_stats()
                decoding = sum(s["running"] for n, s in stats.items() if ":decode" in n)
                if decoding and state["queued"]:
                    break
                assert time.monotonic() < deadline and not all(t.done() for t in tasks), state
                await asyncio.sleep(0.01)
            queued_at_kill = state["queued"]
            ray.kill(controller, no_restart=False)
            killed_at = time.monotonic()
            while True:
                try:
                    state = await asyncio.wait_for(controller.state.remote(), 2.0)
                    if state["incarnation"] != before:
                        break
                except (TimeoutError, ray.exceptions.RayActorError):
                    pass
                assert time.monotonic() - killed_at < REBUILD_S, "the controller did not come back"
                await asyncio.sleep(0.05)
            rebuilt_s = time.monotonic() - killed_at
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            new = await collect(backend, make_request("ctl-after", 40, 8, seed=12))
            return queued_at_kill, rebuilt_s, results, new

        queued_at_kill, rebuilt_s, results, new = asyncio.run(run())
        print(
            f"controller back and rebuilt {rebuilt_s:.2f} s after the kill; {queued_at_kill} request(s) were queued"
        )
        assert queued_at_kill >= 1
        assert rebuilt_s < REBUILD_S
        assert_all_equal_hf(results, reqs, hf_reference("tiny", "cpu"))
        assert new.error is None and len(new.tokens) == 8
        stats = asyncio.run(wait_idle(backend, 30))
        for name, s in stats.items():
            assert s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == NUM_BLOCKS, (name, s)
            assert s["integrity_error"] is None, (name, s)
        state = ray.get(controller.state.remote())
        assert state["incarnation"] != before
        assert state["in_cluster"] == 0 and state["queued"] == 0, state
        assert all(w["reserved"] == 0 and w["outstanding"] == 0 for w in state["prefill"].values()), state
        assert all(w["reserved"] == 0 and w["alive"] for w in state["decode"].values()), state
        assert asyncio.run(backend.health())["ready"] is True
    finally:
        asyncio.run(backend.shutdown())


def assert_all_end_naming(victim: str, killed_at: float, results: list) -> None:
    """Every request ended with an error naming the dead worker, within 5 s of its death."""
    for g in results:
        assert g.finish_reason == "error" and victim in (g.error or ""), (g.request_id, g.error)
        assert g.finished_at - killed_at < 5.0, f"{g.request_id} ended {g.finished_at - killed_at:.1f}s late"


def test_a_dead_worker_ends_the_requests_of_every_gateway(ray_session):
    """Two gateways (Ray Serve replicas) on one cluster, a request of each on the one decode worker: both end
    with an error naming it when it dies, not only the first gateway's to ask the controller."""
    first = RayClusterBackend(cluster_config("disaggregated", "two-gw"))
    second = RayClusterBackend(first.config, launch=False)
    victim = first.config.actor_name("decode", 0)
    try:

        async def run():
            tasks = [
                asyncio.ensure_future(collect(gw, make_request(f"gw{i}", 30, 200, seed=13)))
                for i, gw in enumerate((first, second))
            ]
            deadline = time.monotonic() + 60
            while (await first.handles.workers[victim].handle.stats.remote())["running"] < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            ray.kill(first.handles.workers[victim].handle)
            killed_at = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return killed_at, results

        assert_all_end_naming(victim, *asyncio.run(run()))
        state = ray.get(first.handles.controller.state.remote())
        assert state["in_cluster"] == 0, state
    finally:
        asyncio.run(second.shutdown())
        asyncio.run(first.shutdown())


def test_a_dead_prefill_worker_ends_the_requests_of_every_gateway(ray_session):
    """The same with the prefill worker: it is stopped (SIGSTOP) so that a request of each gateway is planned onto
    it and held there, then killed. Both requests end with an error naming it, within seconds, and the decode
    worker's reservations for them are freed."""
    # Elastic prefill off: an idle decode worker would otherwise prefill the second request itself.
    first = RayClusterBackend(cluster_config("disaggregated", "two-gw-prefill", elastic=False))
    second = RayClusterBackend(first.config, launch=False)
    victim = first.config.actor_name("prefill", 0)
    handle = first.handles.workers[victim].handle
    pid = ray.get(handle.__ray_call__.remote(lambda _: os.getpid()))
    stopped = False
    try:

        async def run():
            os.kill(pid, signal.SIGSTOP)
            nonlocal stopped
            stopped = True
            tasks = [
                asyncio.ensure_future(collect(gw, make_request(f"pgw{i}", 30, 20, seed=17 + i)))
                for i, gw in enumerate((first, second))
            ]
            deadline = time.monotonic() + 30
            while True:
                # Both requests planned (in one batch or two: a worker takes up to two) and none still queued.
                state = await first.handles.controller.state.remote()
                if (
                    state["in_cluster"] == 2
                    and state["queued"] == 0
                    and state["prefill"][victim]["outstanding"]
                ):
                    break
                assert time.monotonic() < deadline, (
                    f"the two requests were not planned onto the worker: {state}"
                )
                await asyncio.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return killed_at, results

        assert_all_end_naming(victim, *asyncio.run(run()))
        state = ray.get(first.handles.controller.state.remote())
        assert state["in_cluster"] == 0 and state["queued"] == 0, state
        assert all(d["reserved"] == 0 for d in state["decode"].values()), state
        decode = first.config.actor_name("decode", 0)
        stats = ray.get(first.handles.workers[decode].handle.stats.remote())
        assert stats["kv_blocks_used"] == 0, stats
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        asyncio.run(second.shutdown())
        asyncio.run(first.shutdown())


def test_monitor_killed_comes_back_and_the_workers_report_to_it_again(ray_session):
    backend = RayClusterBackend(cluster_config("disaggregated", "mon-restart"))
    monitor = backend.handles.monitor
    try:
        assert asyncio.run(collect(backend, make_request("mon0", 20, 4, seed=14))).error is None
        ray.kill(monitor, no_restart=False)
        killed_at = time.monotonic()

        async def after() -> tuple[float, str]:
            while True:
                with_workers = ""
                try:
                    text = await asyncio.wait_for(backend.metrics_text(), 2.0)
                    if all(f'worker_id="{n}"' in text for n in backend.handles.workers):
                        with_workers = text
                except (TimeoutError, ray.exceptions.RayActorError):
                    pass
                if with_workers:
                    return time.monotonic() - killed_at, with_workers
                assert time.monotonic() - killed_at < REBUILD_S + 10, "the monitor did not come back"
                await asyncio.sleep(0.2)

        back_s, text = asyncio.run(after())
        print(f"monitor back with every worker's series {back_s:.2f} s after the kill")
        assert "bucketserve:worker_up" in text
        # Serving never depended on it, and does not now.
        assert asyncio.run(collect(backend, make_request("mon1", 20, 4, seed=15))).error is None
    finally:
        asyncio.run(backend.shutdown())
