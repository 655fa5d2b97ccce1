"""Submits over the controller's socket (``Controller.submit_channel``): a real Unix socket into an in-process
controller, whose prefill worker is a stand-in that records the batches it is handed."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import ray

from bucket_manager.controller import Controller, ControllerConfig
from bucket_manager.dispatch_socket import DispatchChannel, encode_frame
from bucket_manager.request import PriorityClass, RequestSummary
from bucket_manager.shape_buckets import ShapeBucketConfig

MAX_MODEL_LEN = 2048


class _Worker:
    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.enqueue = SimpleNamespace(remote=self._enqueue)

    def _enqueue(self, batch_id: int, items: list, dispatched_at: float, borrow_cores: tuple = ()) -> None:
        self.batches.append([str(payload) for payload, _ in items])


def _controller() -> Controller:
    shape = ShapeBucketConfig.from_serving(
        block_size=16, max_model_len=MAX_MODEL_LEN, max_num_prefill_seqs=4, max_num_batched_tokens=2048
    )
    return Controller(
        ControllerConfig(
            block_size=16,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=2048,
            shape_config=shape,
            max_batches_per_prefill_worker=64,
            scheduling="fcfs",  # served in arrival order: the order the socket delivered them in shows
        )
    )


def _summary(i: int, t0: float) -> RequestSummary:
    return RequestSummary(
        request_id=f"s{i}",
        prompt_len=20 + 7 * i,
        max_tokens=8,
        priority_class=PriorityClass.ONLINE,
        priority=0,
        arrival=t0 + 0.001 * i,
        ttft_slo_ms=500.0,
    )


async def _until(cond, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_submits_over_the_socket_are_queued_in_order_and_an_overtaking_abort_drops_its_submit() -> None:
    async def run() -> tuple[list[str], dict, bool]:
        controller = _controller()
        node, path = await controller.submit_channel()
        # The node id is Ray's when an earlier test in this process left Ray running, and "" without Ray (then no
        # gateway would take this socket: it only takes a socket on its own node).
        expected = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        assert node == expected
        channel = DispatchChannel(path)
        t0 = time.time()
        summaries = [_summary(i, t0) for i in range(10)]
        # The abort of s3 (by Ray, in a gateway) overtakes its submit, still in the socket.
        overtook = await controller.abort("s3")
        for s in summaries:
            assert channel.send(encode_frame((s, s.request_id)))
        # Every submit handled: the others queued, s3's dropped (its abort's mark used up).
        await _until(
            lambda: (
                all(f"s{i}" in controller.dispatcher for i in range(10) if i != 3)
                and "s3" not in controller._aborted_unknown
            ),
            "the submits were not all handled",
        )
        assert "s3" not in controller.dispatcher
        prefill, decode = _Worker(), _Worker()
        await controller.register_workers({"p0": (prefill, 100_000)}, {"d0": (decode, 100_000)})
        await _until(lambda: sum(map(len, prefill.batches)) >= len(summaries) - 1, "not all dispatched")
        await asyncio.sleep(0.1)  # nothing more comes (s3 stays dropped)
        state = await controller.state()
        assert controller._task is not None
        controller._task.cancel()
        channel.close()
        return [rid for batch in prefill.batches for rid in batch], state, overtook

    order, state, overtook = asyncio.run(run())
    assert overtook is False  # it did not hold s3 yet
    assert order == [f"s{i}" for i in range(10) if i != 3]
    assert state["submits_by_socket"] == 10 and state["queued"] == 0, state
