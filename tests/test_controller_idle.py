"""An idle controller stays quiet: with nothing queued it reads the monitor and wakes at ``idle_interval_s``, not ten
times a second, and a new request still goes out at once. In-process controller, stand-in workers and monitor."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from bucket_manager.controller import Controller, ControllerConfig
from bucket_manager.request import RequestSummary
from bucket_manager.shape_buckets import ShapeBucketConfig


class _Monitor:
    def __init__(self) -> None:
        self.reads = 0
        self.summary = SimpleNamespace(remote=self._summary)

    async def _summary(self) -> dict:
        self.reads += 1
        return {"free_kv_blocks": {}, "workers": {}}


class _Prefill:
    def __init__(self) -> None:
        self.sent_at: list[float] = []
        self.enqueue = SimpleNamespace(remote=self._enqueue)

    def _enqueue(self, batch_id, items, dispatched_at, borrow_cores=()) -> None:
        self.sent_at.append(time.monotonic())


async def _run(idle_interval_s: float) -> tuple[int, float, bool]:
    """(monitor reads during 1.2 s with nothing queued, seconds from a submit to its dispatch, whether the batch
    was sent before ``submit`` returned)."""
    shape = ShapeBucketConfig.from_serving(
        block_size=16, max_model_len=512, max_num_prefill_seqs=4, max_num_batched_tokens=512
    )
    config = ControllerConfig(
        block_size=16,
        max_model_len=512,
        max_num_batched_tokens=512,
        shape_config=shape,
        idle_interval_s=idle_interval_s,
    )
    controller = Controller(config)
    monitor, prefill = _Monitor(), _Prefill()
    controller._monitor = monitor
    await controller.register_workers({"p0": (prefill, 1000)}, {"d0": (_Prefill(), 1000)})
    try:
        await asyncio.sleep(1.2)
        reads = monitor.reads
        t0 = time.monotonic()
        await controller.submit(RequestSummary("r0", 40, 8, arrival=time.time()), "r0")
        in_submit = bool(prefill.sent_at)  # no turn of the event loop since: the planning loop has not run
        while not prefill.sent_at and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.005)
        return reads, prefill.sent_at[0] - t0, in_submit
    finally:
        assert controller._task is not None
        controller._task.cancel()


def test_an_idle_controller_reads_the_monitor_at_the_idle_interval_and_still_dispatches_at_once() -> None:
    reads, delay, in_submit = asyncio.run(_run(idle_interval_s=1.5))
    assert reads <= 2, f"{reads} reads of the monitor in 1.2 s with nothing queued"
    assert delay < 1.0, f"the request waited {delay:.2f} s for the idle planner"
    # Planned in the submit call itself: the prompt does not wait for a turn of the planning loop.
    assert in_submit, "the batch went out only after submit returned"
    busy_reads, _, _ = asyncio.run(_run(idle_interval_s=0.1))  # the busy pace: ten reads a second
    assert busy_reads >= 5, busy_reads
