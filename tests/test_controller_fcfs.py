"""The FCFS scheduling option of the controller (the DistServe-like baseline of the sweep): one queue served in
arrival order, whatever the priority, class or length. Runs the controller in-process with stand-in workers."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from bucket_manager.controller import Controller, ControllerConfig
from bucket_manager.request import PriorityClass, RequestSummary
from bucket_manager.shape_buckets import ShapeBucketConfig

MAX_MODEL_LEN = 2048


class _Worker:
    """Records the batches the controller hands to a prefill worker (payloads are the request ids)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.enqueue = SimpleNamespace(remote=self._enqueue)

    def _enqueue(
        self, batch_id: int, items: list[tuple[object, str]], dispatched_at: float, borrow_cores: tuple = ()
    ) -> None:
        self.batches.append([str(payload) for payload, _ in items])


def _requests() -> list[RequestSummary]:
    """Arrival order r0..r11: lengths short and long, an urgent integer priority late, offline work early."""
    t0 = time.time()
    lens = [40, 1500, 60, 900, 30, 1200, 50, 700, 20, 1800, 35, 300]
    out = []
    for i, n in enumerate(lens):
        out.append(
            RequestSummary(
                request_id=f"r{i}",
                prompt_len=n,
                max_tokens=16,
                priority_class=PriorityClass.OFFLINE if i in (0, 3) else PriorityClass.ONLINE,
                priority=-5 if i == 10 else 0,
                arrival=t0 + 0.001 * i,
                ttft_slo_ms=500.0,
            )
        )
    return out


async def _service_order(scheduling: str) -> tuple[list[str], list[list[str]]]:
    shape = ShapeBucketConfig.from_serving(
        block_size=16, max_model_len=MAX_MODEL_LEN, max_num_prefill_seqs=4, max_num_batched_tokens=2048
    )
    config = ControllerConfig(
        block_size=16,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=2048,
        shape_config=shape,
        max_batches_per_prefill_worker=64,
        scheduling=scheduling,
    )
    controller = Controller(config)
    reqs = _requests()
    # Everything is queued before any worker exists, so the planner sees the whole queue at once.
    for r in reqs:
        await controller.submit(r, r.request_id)
    prefill, decode = _Worker(), _Worker()
    await controller.register_workers({"p0": (prefill, 100_000)}, {"d0": (decode, 100_000)})
    deadline = time.monotonic() + 10
    while sum(map(len, prefill.batches)) < len(reqs) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert controller._task is not None
    controller._task.cancel()
    order = [rid for batch in prefill.batches for rid in batch]
    assert sorted(order) == sorted(r.request_id for r in reqs), "every request is dispatched once"
    return order, prefill.batches


def test_fcfs_serves_strictly_in_arrival_order() -> None:
    order, batches = asyncio.run(_service_order("fcfs"))
    assert order == [f"r{i}" for i in range(12)]
    assert len(batches) > 1  # batching still happens, it just never reorders


def test_bucket_scheduling_reorders_the_same_queue() -> None:
    # The same queue under the default policy is not served in arrival order (priority, class and length
    # buckets all reorder it): the FCFS test above is not passing by accident.
    order, _ = asyncio.run(_service_order("buckets"))
    assert order != [f"r{i}" for i in range(12)]
    assert order.index("r10") < order.index("r9")  # the urgent late request overtakes earlier ones


def test_unknown_scheduling_is_refused() -> None:
    shape = ShapeBucketConfig.from_serving(block_size=16, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="scheduling"):
        ControllerConfig(
            block_size=16,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=2048,
            shape_config=shape,
            scheduling="sjf",
        )
