"""The capacity simulator and the served controller plan alike: one arrival trace, the same dispatches.

The simulator runs a trace (mixed lengths, classes, priorities and TTFT targets) and every call it makes on its
dispatcher is recorded with the simulated time. The same calls are then replayed on a real :class:`Controller`
(its actor methods and its planning step, in-process, with stand-in workers), built from the
:class:`ControllerConfig` that ``bucketserve serve`` would build for the same settings. Every batch must match:
its id, its requests in order, its prefill and its decode worker. A simulator that configured its dispatcher
differently (sort key, scheduling, theta, batch limit, shapes) or planned with a copy of its own would diverge.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from test_simulator import COST

import bucket_manager.controller as controller_module
from bench.simulator.sim import SimConfig, SimRequest, Simulator
from bucket_manager.controller import Controller, ControllerConfig
from bucket_manager.lending import LendingPolicy
from bucket_manager.priority import PriorityPolicy
from bucket_manager.request import PriorityClass
from bucket_manager.shape_buckets import ShapeBucketConfig
from gateway.cluster_launch import ClusterConfig, controller_config
from worker.info import WorkerInfo

# Few KV blocks, so batches wait for memory and the reservations, not only the queue, shape the plans.
TIGHT = replace(COST, num_blocks=600)
Batch = tuple[int, str, str, tuple[str, ...]]  # batch id, prefill worker, decode worker, request ids


def trace(offline: bool, n: int = 120, seed: int = 7) -> list[SimRequest]:
    """A burst above capacity: short and long prompts, a few urgent priorities, varied TTFT targets and (when
    ``offline``) a third of the requests offline."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(25.0)
        out.append(
            SimRequest(
                f"r{i}",
                rng.choice([rng.randint(8, 120), rng.randint(200, 1900)]),
                rng.randint(1, 60),
                round(t, 6),
                priority_class=PriorityClass.OFFLINE
                if offline and rng.random() < 0.33
                else PriorityClass.ONLINE,
                priority=-1 if rng.random() < 0.1 else 0,
                ttft_slo_ms=rng.choice([None, 300.0, 1500.0]),
            )
        )
    return out


def sim_config(scheduling: str, online_order: str) -> SimConfig:
    return SimConfig(
        TIGHT,
        prefill_workers=2,
        decode_workers=2,
        policy=PriorityPolicy(online_order=online_order, max_online_wait_s=0.5),
        request_buckets=scheduling == "buckets",
        lending=LendingPolicy(enabled=True),  # serve's default (--elastic on)
    )


def served_config(scheduling: str, online_order: str) -> ControllerConfig:
    """What ``serve`` builds: the launcher's own function, from the serve flags and a worker's reported
    facts (its engine's shapes), so a divergence in how the served controller is configured shows here."""
    shapes = ShapeBucketConfig.from_serving(
        strategy="exponential",
        block_size=TIGHT.block_size,
        max_model_len=TIGHT.max_model_len,
        max_num_seqs=TIGHT.max_num_seqs,
        max_num_prefill_seqs=TIGHT.max_num_prefill_seqs,
        max_num_batched_tokens=TIGHT.max_num_batched_tokens,
        num_blocks=TIGHT.num_blocks,
    )
    info = WorkerInfo(
        worker_id="bucketserve:prefill-0",
        role="prefill",
        warmed=True,
        startup_s=0.0,
        warmup={},
        kv_blocks_total=TIGHT.num_blocks,
        block_size=TIGHT.block_size,
        max_model_len=TIGHT.max_model_len,
        max_num_batched_tokens=TIGHT.max_num_batched_tokens,
        shape_config=shapes,
        eos_token_ids=(),
        model_path="",
        device="cpu",
        dtype="float32",
        shape_policy="buckets",
    )
    cluster = ClusterConfig(
        prefill_workers=2,
        decode_workers=2,
        scheduling=scheduling,
        policy=PriorityPolicy(online_order=online_order, max_online_wait_s=0.5),
    )
    # No monitor in this replay: the dispatcher plans from the ledgers alone, as the simulator does.
    return replace(controller_config(cluster, info), monitor_name=None)


def simulate_recorded(config: SimConfig, requests: list[SimRequest]) -> tuple[Simulator, list[tuple]]:
    """Run the trace; returns the simulator and its dispatcher calls as (name, now, args, result)."""
    sim = Simulator(config)
    calls: list[tuple] = []
    d = sim.dispatcher
    for name in ("submit", "plan", "batch_done", "forget"):
        real = getattr(d, name)

        def record(*args: Any, _real: Any = real, _name: str = name) -> Any:
            result = _real(*args)
            calls.append((_name, sim.now, args, result))
            return result

        setattr(d, name, record)
    sim.run_requests(requests)
    return sim, calls


class _PrefillWorker:
    """Records what the controller hands it; payloads are the request ids."""

    def __init__(self, worker_id: str, sent: list[Batch]) -> None:
        def enqueue(
            batch_id: int, items: list[tuple[object, str]], dispatched_at: float, borrow_cores: tuple = ()
        ) -> None:
            decode_ids = {did for _, did in items}
            assert len(decode_ids) == 1, "one decode worker per batch"
            sent.append((batch_id, worker_id, decode_ids.pop(), tuple(str(p) for p, _ in items)))

        self.enqueue = SimpleNamespace(remote=enqueue)


class _DecodeWorker:
    """Records the prompt batches the controller lends it (elastic prefill)."""

    def __init__(self, worker_id: str, sent: list[Batch]) -> None:
        def run_prompts(batch_id: int, payloads: list[object], dispatched_at: float) -> None:
            sent.append((batch_id, worker_id, worker_id, tuple(str(p) for p in payloads)))

        self.run_prompts = SimpleNamespace(remote=run_prompts)


def replay_on_controller(
    config: ControllerConfig, sim: Simulator, calls: list[tuple], monkeypatch: pytest.MonkeyPatch
) -> tuple[Controller, list[Batch]]:
    sent: list[Batch] = []
    clock = {"now": 0.0}

    async def no_loop(self: Controller) -> None:  # planning is driven step by step below
        return None

    monkeypatch.setattr(Controller, "_run", no_loop)
    monkeypatch.setattr(
        controller_module, "time", SimpleNamespace(time=lambda: clock["now"], monotonic=time.monotonic)
    )

    async def replay() -> Controller:
        controller = Controller(config)
        prefill = {p.wid: (_PrefillWorker(p.wid, sent), p.ledger.total_blocks) for p in sim.prefill}
        decode = {d.wid: (_DecodeWorker(d.wid, sent), d.ledger.total_blocks) for d in sim.decode}
        await controller.register_workers(prefill, decode)
        for name, now, args, _ in calls:
            clock["now"] = now
            if name == "submit":
                await controller.submit(args[0], args[0].request_id)
            elif name == "batch_done":
                await controller.batch_done(*args)
            elif name == "forget":
                await controller.release(*args)
            else:
                controller._plan_all()
        return controller

    return asyncio.run(replay()), sent


def dispatched(calls: list[tuple]) -> list[Batch]:
    return [
        (b.batch_id, b.prefill_id, b.decode_id, b.request_ids)
        for name, _, _, result in calls
        if name == "plan"
        for b in result
    ]


@pytest.mark.parametrize("online_order", ["arrival", "deadline", "sjf"])
@pytest.mark.parametrize("offline", [False, True], ids=["online", "with_offline"])
@pytest.mark.parametrize("scheduling", ["buckets", "fcfs"])
def test_simulator_and_controller_dispatch_the_same_batches(
    scheduling: str, offline: bool, online_order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = trace(offline)
    sim, calls = simulate_recorded(sim_config(scheduling, online_order), requests)
    assert all(r.finish is not None for r in requests), "the trace runs to the end"
    controller, sent = replay_on_controller(served_config(scheduling, online_order), sim, calls, monkeypatch)
    # Configured alike: what serve builds for these flags is what the simulator plans with.
    assert controller.dispatcher.config == sim.dispatcher.config
    planned = dispatched(calls)
    assert sent == planned
    # The comparison has substance: many batches, over both prefill and both decode workers, every request once.
    assert len(planned) >= 30
    assert {b[1] for b in planned if b[1] != b[2]} == {"prefill-0", "prefill-1"}
    assert {b[2] for b in planned} == {"decode-0", "decode-1"}
    # Elastic prefill (serve's default) too: batches lent to a decode worker, planned alike on both ends.
    assert any(b[1] == b[2] for b in planned)
    order = [rid for b in planned for rid in b[3]]
    assert sorted(order) == sorted(r.rid for r in requests)
    # Both ends agree on the ledgers at the end too: nothing queued, nothing reserved.
    assert controller.dispatcher.state() == sim.dispatcher.state()
    assert controller.dispatcher.state()["in_cluster"] == 0


@pytest.mark.parametrize("online_order", ["arrival", "deadline", "sjf"])
def test_simulated_fcfs_serves_in_arrival_order(online_order: str) -> None:
    # The simulator's FCFS baseline is the served one: arrival order whatever the class, priority or length
    # (it once kept the priority policy's sort key, so sjf or offline traffic reordered it).
    requests = trace(offline=True)
    _, calls = simulate_recorded(sim_config("fcfs", online_order), requests)
    order = [rid for b in dispatched(calls) for rid in b[3]]
    assert order == [r.rid for r in sorted(requests, key=lambda r: r.arrival)]
    _, calls = simulate_recorded(sim_config("buckets", online_order), requests)
    assert [rid for b in dispatched(calls) for rid in b[3]] != order


def test_a_differently_configured_simulator_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # The replay is not a tautology: a simulator planning with another policy than the served one diverges.
    requests = trace(offline=True)
    sim, calls = simulate_recorded(sim_config("buckets", "sjf"), requests)
    _, sent = replay_on_controller(served_config("buckets", "arrival"), sim, calls, monkeypatch)
    assert sent != dispatched(calls)
