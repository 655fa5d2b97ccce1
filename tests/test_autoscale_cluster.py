"""Autoscaling on the running cluster (real Ray actors, real model): a burst that one prefill worker cannot keep
up with makes the controller start a second one, which joins and takes batches; once the cluster has been idle,
that worker is drained and removed. Every request is answered, token for token equal to Hugging Face greedy, and
no KV block is left in use. The times from the queue wait crossing its budget to the decision, and from the
decision to the new worker serving, are printed and bounded (10 s and 45 s)."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from cluster_helpers import assert_all_equal_hf, collect, make_request, wait_idle
from prometheus_client.parser import text_string_to_metric_families

from bucket_manager.autoscale import ScalingConfig
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from gateway.cluster_backend import RayClusterBackend
from gateway.cluster_launch import ClusterConfig

pytestmark = pytest.mark.slow

SCALING = ScalingConfig(
    min_prefill_workers=1,
    max_prefill_workers=2,
    scale_ttft_budget_s=0.3,
    breach_s=1.0,
    scale_idle_s=4.0,
    cooldown_s=2.0,
)
IN_FLIGHT = 96  # requests kept open during the burst: a queue one prefill worker takes seconds to clear


def _config() -> ClusterConfig:
    engine = EngineConfig(
        model="tiny",
        device="cpu",
        skip_warmup=True,
        cache=CacheConfig(block_size=16, num_blocks=2048),
        # One prompt per prefill batch: the prefill worker is the bottleneck, decode (4 tokens each) is not.
        scheduler=SchedulerConfig(
            max_model_len=512, max_num_seqs=64, max_num_prefill_seqs=1, max_num_batched_tokens=512
        ),
    )
    return ClusterConfig(
        engine=engine,
        mode="disaggregated",
        name="autoscale",
        namespace="bucketserve-tests",
        worker_num_cpus=0.5,
        scaling=SCALING,
    )


def _events(state: dict) -> list[dict]:
    return state.get("scaling", {}).get("events", [])


def test_a_burst_scales_prefill_up_and_idle_scales_it_back(ray_session, hf_reference) -> None:
    backend = RayClusterBackend(_config())
    controller = backend.handles.controller
    new_worker = backend.config.actor_name("prefill", 1)
    try:

        async def burst():
            sem = asyncio.Semaphore(IN_FLIGHT)
            reqs, tasks = [], []

            async def one(req):
                async with sem:
                    return await collect(backend, req)

            deadline = time.monotonic() + 90
            stop_at = None
            i = 0
            while stop_at is None or time.monotonic() < stop_at:
                # Keep the queue full until the new worker has served for a couple of seconds.
                while len(tasks) - sum(t.done() for t in tasks) < IN_FLIGHT + 8:
                    req = make_request(f"burst{i}", 480, 4, seed=5)
                    reqs.append(req)
                    tasks.append(asyncio.ensure_future(one(req)))
                    i += 1
                await asyncio.sleep(0.1)
                state = await controller.state.remote()
                up = [e for e in _events(state) if e["direction"] == "up"]
                if stop_at is None and up and up[0]["decision_to_done_s"] is not None:
                    stop_at = time.monotonic() + 3.0
                assert time.monotonic() < deadline, f"no scale-up within 90 s: {state.get('scaling')}"
            return reqs, await asyncio.gather(*tasks)

        async def idle_down():
            # The gateway's own loop keeps running meanwhile: it follows the controller's member list.
            deadline = time.monotonic() + SCALING.scale_idle_s + SCALING.cooldown_s + 30
            while True:
                state = await controller.state.remote()
                down = [e for e in _events(state) if e["direction"] == "down"]
                if (
                    down
                    and down[0]["decision_to_done_s"] is not None
                    and new_worker not in backend.handles.workers
                ):
                    return state, down
                assert time.monotonic() < deadline, state.get("scaling")
                await asyncio.sleep(0.5)

        async def main():
            reqs, results = await burst()
            joined = new_worker in backend.handles.workers
            stats = await backend.handles.workers[new_worker].handle.stats.remote() if joined else {}
            state, down = await idle_down()
            return reqs, results, joined, stats, state, down

        reqs, results, joined, stats, state, down = asyncio.run(main())
        assert joined, "the gateway did not read from the new worker"
        assert stats["prefill_steps"] > 0, f"{new_worker} joined but ran no batch: {stats}"
        assert all(g.error is None for g in results), [g.error for g in results if g.error][:3]
        # A sample, token for token (all of them would take the reference minutes).
        assert_all_equal_hf(results[::25], reqs[::25], hf_reference("tiny", "cpu"))
        assert list(state["prefill"]) == [backend.config.actor_name("prefill", 0)]
        assert down[0]["worker_id"] == new_worker
        time.sleep(3.0)  # retire_grace_s: then the actor is gone
        with pytest.raises(ValueError):
            ray.get_actor(new_worker, namespace="bucketserve-tests")

        (up,) = [e for e in _events(state) if e["direction"] == "up"]
        print(
            f"autoscaling: queue wait over budget -> decision {up['signal_to_decision_s']} s, decision -> serving "
            f"{up['decision_to_done_s']} s; idle -> drain decision {down[0]['signal_to_decision_s']} s, drained and "
            f"removed {down[0]['decision_to_done_s']} s later; {len(results)} requests"
        )
        # Decision -> serving is a process start, imports and a model load on a 2-core box busy with the burst:
        # 9-11 s on the AVX-512 host, 30.5 s once on a slower AVX2 one.
        assert up["signal_to_decision_s"] <= 10.0 and up["decision_to_done_s"] <= 45.0, up

        families = {f.name: f for f in text_string_to_metric_families(asyncio.run(backend.metrics_text()))}
        events = {
            (s.labels["role"], s.labels["direction"]): s.value
            for s in families["bucketserve:scaling_events"].samples
            if s.name.endswith("_total")
        }
        assert events[("prefill", "up")] == 1 and events[("prefill", "down")] == 1, events
        for name, s in asyncio.run(wait_idle(backend, timeout=30)).items():
            assert s["kv_blocks_used"] == 0, (name, s)
    finally:
        asyncio.run(backend.shutdown())
