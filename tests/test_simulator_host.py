"""Host CPU contention in the simulator: processor sharing, the host model's effect, and per-process CPU read
from /proc for a real process tree. Pure Python, no Ray, no model."""

from __future__ import annotations

import heapq
import itertools
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from test_simulator import config

from bench.simulator.host import HostModel, SharedCpu
from bench.simulator.proc_cpu import cluster_cpu, process_cpu
from bench.simulator.sim import simulate


class Clock:
    """A minimal event loop for SharedCpu."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn, args))

    def run(self) -> None:
        while self.events:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)


def test_processor_sharing_stretches_work_by_the_number_of_runnable_entities() -> None:
    clock = Clock()
    cpu = SharedCpu(1.0, lambda: clock.now, clock.at)
    done: dict[str, float] = {}
    cpu.run("a", 1.0, lambda: done.setdefault("a", clock.now))
    cpu.run("b", 2.0, lambda: done.setdefault("b", clock.now))
    clock.run()
    # One core, two entities: each at half speed until a is served at t=2, then b alone for its last second.
    assert done["a"] == pytest.approx(2.0)
    assert done["b"] == pytest.approx(3.0)
    assert cpu.busy_s == pytest.approx({"a": 1.0, "b": 2.0})


def test_enough_cores_no_stretch_and_host_pieces_run_in_order() -> None:
    clock = Clock()
    cpu = SharedCpu(2.0, lambda: clock.now, clock.at)
    order: list[tuple[str, float]] = []
    cpu.run("worker", 1.0, lambda: order.append(("worker", clock.now)))
    for i in range(3):
        cpu.host(0.25, lambda i=i: order.append((f"host{i}", clock.now)))
    clock.run()
    names = [n for n, _ in order]
    assert names.index("host0") < names.index("host1") < names.index("host2")
    assert dict(order) == pytest.approx({"worker": 1.0, "host0": 0.25, "host1": 0.5, "host2": 0.75})
    with pytest.raises(RuntimeError, match="already running"):
        cpu.run("w", 1.0, lambda: None)
        cpu.run("w", 1.0, lambda: None)


def test_host_model_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="cores"):
        HostModel(cores=0)
    with pytest.raises(ValueError, match="host_token_cpu_s"):
        HostModel(cores=2, host_token_cpu_s=-1)
    with pytest.raises(ValueError, match="decode_cpu_factor"):
        HostModel(cores=2, decode_cpu_factor=0)


def test_free_host_changes_nothing_and_contention_lowers_attainment() -> None:
    base = config()
    bare = simulate(base, "mixed", 4.0, 150, seed=5).summary()
    # Plenty of cores, no host work, no worker overhead: the same run through the processor-sharing path.
    free = simulate(replace(base, host=HostModel(cores=8)), "mixed", 4.0, 150, seed=5).summary()
    for key in ("slo_attainment", "ttft_p50_ms", "tpot_p50_ms", "completed", "decode_steps"):
        assert free[key] == pytest.approx(bare[key]), key
    busy = HostModel(cores=1.5, host_token_cpu_s=2e-3, prefill_cpu_factor=1.5, decode_cpu_factor=2.0)
    loaded = simulate(replace(base, host=busy), "mixed", 4.0, 150, seed=5).summary()
    assert loaded["completed"] == 150
    assert loaded["tpot_p50_ms"] > bare["tpot_p50_ms"]
    assert loaded["slo_attainment"] < bare["slo_attainment"]
    # The engine time is counted before the factors: its sum stays what the calibration says the batches cost.
    assert loaded["decode_engine_s"] > 0 and loaded["prefill_engine_s"] > 0


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="per-process CPU is read from Linux /proc")
def test_process_cpu_attributes_a_busy_child_by_its_actor_name() -> None:
    # Each child burns 0.6 s of CPU, then stays alive 2 s so that the reading below catches it.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(2)\n"
    before = process_cpu(os.getpid())
    # A child named like a Ray worker process that hosts a decode actor, and one that is not a worker.
    named = subprocess.Popen(
        ["bash", "-c", f'exec -a "ray::DecodeWorker.step" {sys.executable} -c "$0"', burn]
    )
    plain = subprocess.Popen([sys.executable, "-c", burn])
    deadline = time.monotonic() + 30
    after = process_cpu(os.getpid())
    while time.monotonic() < deadline:
        after = process_cpu(os.getpid())
        if all(p.pid in after and after[p.pid][1] >= 0.5 for p in (named, plain)):
            break
        time.sleep(0.05)
    used = cluster_cpu(before, after)
    named.wait(30)
    plain.wait(30)
    assert after[named.pid][0] == "decode" and after[plain.pid][0] == "host"
    assert used["decode"] >= 0.5
    assert used["host"] >= 0.5
    assert used["prefill"] == 0.0
