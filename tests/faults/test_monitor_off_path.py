"""Nothing on the serving path waits on the monitor.

- The controller plans while the monitor hangs: from its own ledger when there are no figures, and from its own
  ledger again once the last figures are too old (a worker reported full just before the monitor hung must not
  hold planning at zero for ever). It keeps one read in flight, not a backlog, and says so once, not per tick.
- A JSON answer does not wait for its request to be recorded: a backend whose ``record`` never returns still
  answers at once (real gateway, real tiny model).

The controller runs in-process with stand-in workers and a stand-in monitor, as in test_controller_fcfs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from gateway_helpers import serve_app, tiny_config

from bucket_manager.controller import Controller, ControllerConfig
from bucket_manager.request import PriorityClass, RequestSummary
from bucket_manager.shape_buckets import ShapeBucketConfig
from gateway.app import create_app
from gateway.local_backend import LocalEngineBackend
from gateway.settings import GatewaySettings
from monitor.records import RequestRecord

MAX_MODEL_LEN = 2048
BLOCKS = 1000
MAX_AGE_S = 0.5


class _Worker:
    """Records the batches the controller hands to a prefill worker (payloads are the request ids)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.enqueue = SimpleNamespace(remote=self._enqueue)

    def _enqueue(
        self, batch_id: int, items: list[tuple[object, str]], dispatched_at: float, borrow_cores: tuple = ()
    ) -> None:
        self.batches.append([str(payload) for payload, _ in items])


class _Monitor:
    """Answers ``summary`` with the given figures while ``answering``; otherwise the call never returns (a hung
    monitor, or one whose store is hung)."""

    def __init__(self, figures: dict | None) -> None:
        self.figures = figures
        self.answering = figures is not None
        self.calls = 0
        self.pending: list[asyncio.Future] = []
        self.summary = SimpleNamespace(remote=self._summary)
        self.set_buckets = SimpleNamespace(remote=lambda *args: None)

    def _summary(self) -> asyncio.Future:
        self.calls += 1
        answer = asyncio.get_running_loop().create_future()
        if self.answering:
            answer.set_result(self.figures)
        else:
            self.pending.append(answer)
        return answer

    def answer_again(self) -> None:
        """The monitor is back: the hung call gets its (late) answer, and later calls theirs at once."""
        self.answering = True
        for answer in self.pending:
            answer.set_result(self.figures)
        self.pending.clear()


def _config() -> ControllerConfig:
    shape = ShapeBucketConfig.from_serving(
        block_size=16, max_model_len=MAX_MODEL_LEN, max_num_prefill_seqs=4, max_num_batched_tokens=2048
    )
    return ControllerConfig(
        block_size=16,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=2048,
        shape_config=shape,
        max_batches_per_prefill_worker=64,
        stats_max_age_s=MAX_AGE_S,
        stats_first_wait_s=MAX_AGE_S,
        idle_interval_s=MAX_AGE_S / 2,
    )


def _request(rid: str) -> RequestSummary:
    return RequestSummary(
        request_id=rid,
        prompt_len=100,
        max_tokens=16,
        priority_class=PriorityClass.ONLINE,
        priority=0,
        arrival=time.time(),
    )


async def _start(monitor: _Monitor) -> tuple[Controller, _Worker]:
    controller = Controller(_config())
    controller._monitor = monitor  # what register_workers would look up by name
    prefill, decode = _Worker(), _Worker()
    await controller.register_workers({"p0": (prefill, BLOCKS)}, {"d0": (decode, BLOCKS)})
    return controller, prefill


async def _dispatched_within(prefill: _Worker, n: int, seconds: float) -> float:
    t0 = time.monotonic()
    while sum(map(len, prefill.batches)) < n:
        assert time.monotonic() - t0 < seconds, f"{sum(map(len, prefill.batches))} of {n} dispatched"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


def _stale_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "monitor figures are" in r.getMessage()]


def test_controller_plans_while_the_monitor_hangs(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        monitor = _Monitor(None)  # never answers
        controller, prefill = await _start(monitor)
        try:
            await controller.submit(_request("r0"), "r0")
            assert await _dispatched_within(prefill, 1, 1.0) < 1.0
            await asyncio.sleep(4 * MAX_AGE_S)  # many planning ticks with the read still hung
            await controller.submit(_request("r1"), "r1")
            await _dispatched_within(prefill, 2, 1.0)
            assert monitor.calls == 1, "a hung read is not piled on with more reads"
        finally:
            assert controller._task is not None
            controller._task.cancel()

    with caplog.at_level(logging.WARNING, logger="bucket_manager.controller"):
        asyncio.run(run())
    [warning] = _stale_warnings(caplog)  # once for the outage, not once per tick
    assert "no answer yet" in warning


def test_stale_figures_are_dropped_and_fresh_ones_used_again(caplog: pytest.LogCaptureFixture) -> None:
    full = {"free_kv_blocks": {"p0": BLOCKS, "d0": 0}, "workers": {}}

    async def run() -> None:
        monitor = _Monitor(full)  # the decode worker is full...
        controller, prefill = await _start(monitor)
        try:
            while controller._stats_read is not None or monitor.calls == 0:
                await asyncio.sleep(0.01)  # the first figures are in
            await controller.submit(_request("r0"), "r0")
            await asyncio.sleep(MAX_AGE_S / 2)
            assert not prefill.batches, "nothing fits on a worker reported full"
            monitor.answering = False  # ...and then the monitor hangs with that figure as its last word
            calls = monitor.calls
            # Once the figure is older than stats_max_age_s the controller goes by its own ledger (free here).
            assert await _dispatched_within(prefill, 1, MAX_AGE_S + 1.0) > 0
            await asyncio.sleep(2 * MAX_AGE_S)
            assert len(_stale_warnings(caplog)) == 1
            assert monitor.calls <= calls + 1 and len(monitor.pending) == 1, (
                "one read in flight, not a backlog"
            )
            # The monitor answers again: its figures (still full) hold planning back again.
            monitor.answer_again()
            await asyncio.sleep(0.3)
            await controller.submit(_request("r1"), "r1")
            await asyncio.sleep(MAX_AGE_S / 2)
            assert sum(map(len, prefill.batches)) == 1, "fresh figures are used again"
        finally:
            assert controller._task is not None
            controller._task.cancel()

    with caplog.at_level(logging.WARNING, logger="bucket_manager.controller"):
        asyncio.run(run())
    stale, fresh = _stale_warnings(caplog)
    assert " s old (no answer yet); planning from the controller's own ledger" in stale
    assert fresh == "monitor figures are fresh again"


class _UnrecordedBackend(LocalEngineBackend):
    """A backend whose monitor never takes a record (its store hangs)."""

    def __init__(self) -> None:
        super().__init__(tiny_config(), stats_interval_s=0.2)
        self.recording: list[str] = []

    async def record(self, rec: RequestRecord) -> None:
        self.recording.append(rec.request_id)
        await asyncio.Event().wait()


def test_a_json_answer_does_not_wait_for_its_record() -> None:
    backend = _UnrecordedBackend()
    try:
        with serve_app(create_app(backend, GatewaySettings())) as url:
            body: dict[str, Any] = {"prompt": "hello there", "max_tokens": 4, "ignore_eos": True}
            with httpx.Client(base_url=url, timeout=20) as c:
                for _ in range(3):
                    t0 = time.monotonic()
                    r = c.post("/v1/completions", json=body)
                    took = time.monotonic() - t0
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["completion_tokens"] == 4
                    assert took < 5.0, f"the answer took {took:.1f} s"
                    chat = c.post(
                        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                    )
                    assert chat.status_code == 200, chat.text
        assert len(backend.recording) == 6, "every request was handed to the recorder"
    finally:
        backend.close()
