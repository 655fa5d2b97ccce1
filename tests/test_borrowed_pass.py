"""A prefill pass on borrowed cores gives them back between layers when their owner asks (``worker/borrowed_pass.py``):
real core gates (``flock`` in a temporary directory), real affinity and torch thread counts, a thread as the owner."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from test_worker_cores import _in_thread, needs_two_cores

from worker.borrowed_pass import BorrowedPass
from worker.core_gate import CoreGate
from worker.cores import borrowed_cores


@needs_two_cores
def test_the_pass_narrows_to_its_own_core_and_lets_the_owner_step_at_the_next_layer(tmp_path) -> None:
    owner = CoreGate((1,), str(tmp_path))
    stepped: list[float] = []
    layers_seen: list[int] = []

    def owner_step() -> None:
        with owner.step(want=True):
            stepped.append(time.monotonic())

    def body():
        os.sched_setaffinity(0, {0})
        torch.set_num_threads(1)
        gate = CoreGate((1,), str(tmp_path))
        seen = {}
        try:
            with gate.borrow() as held, borrowed_cores((0,), 1, (1,)) as threads:
                assert held and threads == 2
                widened = BorrowedPass(gate, (0,), 1, speedup=1.8, then=layers_seen.append)
                a = torch.randn(256, 256)
                for layer in range(6):
                    if layer == 2:  # a prompt is lent to the owner mid-pass
                        t = threading.Thread(target=owner_step)
                        t.start()
                        deadline = time.monotonic() + 5
                        while not gate.wanted():
                            assert time.monotonic() < deadline
                            time.sleep(0.002)
                    _ = a @ a  # the layer's compute
                    widened.on_layer_written(layer)
                    if layer == 2:
                        seen["at_give_back"] = (torch.get_num_threads(), os.sched_getaffinity(0))
                        t.join(5)
                        seen["owner_stepped_inside_the_pass"] = bool(stepped)
                seen["given_after"] = widened.given_back_after_layer
                seen["equivalent"] = widened.widened_equivalent_s(1.0)
                seen["given_s"] = widened.given_back_at - widened.started
        finally:
            gate.close()
        seen["after"] = (torch.get_num_threads(), os.sched_getaffinity(0))
        return seen

    try:
        seen = _in_thread(body)
    finally:
        owner.close()
    assert layers_seen == list(range(6)), "the pass's own hook (KV streaming) runs for every layer"
    assert seen["given_after"] == 2
    assert seen["at_give_back"] == (1, {0}), "off the borrowed core before the owner steps there"
    assert seen["owner_stepped_inside_the_pass"]
    assert seen["after"] == (1, {0})
    # One second in all, the first given_s of it widened: the rest counts as 1/1.8 of its time, as a widened pass.
    g = seen["given_s"]
    assert seen["equivalent"] == pytest.approx(g + (1.0 - g) / 1.8)


def test_a_pass_nobody_asks_keeps_the_cores_and_reports_its_time_as_it_was(tmp_path) -> None:
    gate = CoreGate((1,), str(tmp_path))
    try:
        with gate.borrow() as held:
            assert held
            widened = BorrowedPass(gate, (), 1, speedup=1.8)
            for layer in range(4):
                widened.on_layer_written(layer)
            assert widened.given_back_at is None
            assert widened.widened_equivalent_s(0.7) == 0.7
    finally:
        gate.close()
