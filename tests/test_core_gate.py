"""The core gate (``worker/core_gate.py``): a decode worker's steps and a borrowing prefill worker's forward pass never
overlap on a core, the borrower waits for at most the step in progress, and a borrower that dies lets go. Real
``flock`` locks in a temporary directory, between threads (each gate opens its own files, as each worker process
does) and between processes."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

from worker.core_gate import CoreGate


def _owner_loop(gate: CoreGate, stop: threading.Event, step_s: float, log: list) -> None:
    """A decode worker's loop: one step after another, each holding the cores for ``step_s``."""
    while not stop.is_set():
        with gate.step():
            log.append(("step", time.monotonic()))
            time.sleep(step_s)
            log.append(("end", time.monotonic()))


def test_a_borrower_waits_only_for_the_step_in_progress_and_no_step_runs_while_it_holds(tmp_path) -> None:
    owner, borrower = CoreGate((3,), str(tmp_path)), CoreGate((3,), str(tmp_path))
    stop, log = threading.Event(), []
    t = threading.Thread(target=_owner_loop, args=(owner, stop, 0.02, log))
    t.start()
    try:
        time.sleep(0.1)  # the owner steps back to back
        waits = []
        for _ in range(5):
            asked = time.monotonic()
            with borrower.borrow():
                got = time.monotonic()
                steps_before = sum(1 for kind, _ in log if kind == "step")
                time.sleep(0.1)
                steps_during = sum(1 for kind, _ in log if kind == "step") - steps_before
            waits.append(got - asked)
            assert steps_during == 0, "the owner stepped while the cores were borrowed"
            time.sleep(0.05)
    finally:
        stop.set()
        t.join()
        owner.close()
        borrower.close()
    # About the 20 ms step in progress (the turnstile keeps the owner from taking the cores again first).
    assert max(waits) < 0.1, waits
    ends = [ts for kind, ts in log if kind == "end"]
    assert len(ends) > 10, "the owner went on stepping between the borrows"


def test_steps_never_overlap_a_borrow(tmp_path) -> None:
    owner, borrower = CoreGate((0, 1), str(tmp_path)), CoreGate((1, 0), str(tmp_path))
    inside = {"owner": 0, "borrower": 0}
    overlaps = []
    stop = threading.Event()

    def run(gate_cm, who, hold_s):
        while not stop.is_set():
            with gate_cm():
                inside[who] += 1
                if inside["owner"] and inside["borrower"]:
                    overlaps.append(who)
                time.sleep(hold_s)
                inside[who] -= 1
            time.sleep(0.001)

    threads = [
        threading.Thread(target=run, args=(owner.step, "owner", 0.003)),
        threading.Thread(target=run, args=(borrower.borrow, "borrower", 0.005)),
    ]
    for th in threads:
        th.start()
    time.sleep(0.5)
    stop.set()
    for th in threads:
        th.join()
    owner.close()
    borrower.close()
    assert overlaps == []


def _hold_and_die(directory: str, ready) -> None:
    gate = CoreGate((5,), directory)
    with gate.borrow():
        ready.set()
        time.sleep(60)


def test_a_borrower_that_dies_holding_the_cores_blocks_nothing(tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_and_die, args=(str(tmp_path), ready))
    p.start()
    try:
        assert ready.wait(30), "the borrower process did not start"
        owner = CoreGate((5,), str(tmp_path))
        stepped = threading.Event()

        def one_step() -> None:
            with owner.step():
                stepped.set()

        t = threading.Thread(target=one_step, daemon=True)
        t.start()
        assert not stepped.wait(0.3), "the owner stepped while another process held its cores"
        p.kill()
        assert stepped.wait(5), "the cores stayed held after the borrower died"
        t.join()
        owner.close()
    finally:
        if p.is_alive():
            p.kill()
        p.join()


def test_a_gate_of_no_cores_is_a_no_op(tmp_path) -> None:
    gate = CoreGate((), str(tmp_path))
    with gate.step(), gate.borrow():  # nested: nothing is locked, nothing waits
        pass
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("cores", [(2,), (0, 7)])
def test_the_gate_files_are_per_core_and_private(tmp_path, cores) -> None:
    gate = CoreGate(cores, str(tmp_path / "gates"))
    names = sorted(os.listdir(tmp_path / "gates"))
    assert names == sorted([f"core-{c}.lock" for c in cores] + [f"core-{c}.turn" for c in cores])
    assert (os.stat(tmp_path / "gates").st_mode & 0o777) == 0o700
    gate.close()


def test_two_workers_that_borrow_each_others_cores_never_deadlock_nor_overlap(tmp_path) -> None:
    """Colocated workers (worker/neighbour_cores.py): each steps on its own core and now and then borrows both;
    a widened step takes the gates of all its cores as one borrower, so two that widen at once queue."""
    own = {"a": (0,), "b": (1,)}
    running: dict[str, set[int]] = {"a": set(), "b": set()}
    overlaps, counts = [], {"a": 0, "b": 0}
    lock = threading.Lock()
    stop = threading.Event()

    def worker(name: str) -> None:
        plain, wide = CoreGate(own[name], str(tmp_path)), CoreGate((0, 1), str(tmp_path))
        i = 0
        while not stop.is_set():
            cores, cm = ((0, 1), wide.borrow()) if i % 3 == 0 else (own[name], plain.step())
            with cm:
                with lock:
                    other = running["b" if name == "a" else "a"]
                    if other & set(cores):
                        overlaps.append((name, cores, set(other)))
                    running[name] = set(cores)
                time.sleep(0.003)
                with lock:
                    running[name] = set()
                    counts[name] += 1
            i += 1
        plain.close()
        wide.close()

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in ("a", "b")]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads), "deadlocked"
    assert overlaps == []
    assert min(counts.values()) > 20, counts


def test_a_stuck_owner_costs_a_borrower_the_limit_then_it_runs_on_its_own(tmp_path, caplog) -> None:
    """An owner that holds its cores far beyond a step (a stopped process, a hung step): the borrower gives up after
    the wait limit, holds nothing (yields False, so its forward runs on its own cores) and says why; once the owner
    lets go, borrowing works again."""
    owner, borrower = CoreGate((4,), str(tmp_path)), CoreGate((4,), str(tmp_path))
    stuck = owner.step(wait_limit_s=1.0)
    stuck.__enter__()
    try:
        asked = time.monotonic()
        with caplog.at_level("WARNING", logger="worker.core_gate"), borrower.borrow(wait_limit_s=0.3) as held:
            waited = time.monotonic() - asked
            assert held is False
        assert 0.3 <= waited < 2.0, waited
        assert "owner held them" in caplog.text and "(4,)" in caplog.text
        # It left its turn free: a second borrower gets as far as the owner's lock too (not "another borrower").
        caplog.clear()
        third = CoreGate((4,), str(tmp_path))
        with caplog.at_level("WARNING", logger="worker.core_gate"), third.borrow(wait_limit_s=0.05) as again:
            assert again is False
        assert "owner held them" in caplog.text and "another borrower" not in caplog.text
        third.close()
    finally:
        stuck.__exit__(None, None, None)
    with borrower.borrow(wait_limit_s=0.3) as held:
        assert held is True
    owner.close()
    borrower.close()


def test_a_stuck_borrower_costs_the_owner_the_limit_then_it_steps_beside_it(tmp_path, caplog) -> None:
    """A borrower that never lets go (stopped mid-forward): the owner's step waits the limit, then runs anyway and
    says why; the decode worker's requests go on, slower, instead of stalling for good."""
    owner, borrower = CoreGate((6,), str(tmp_path)), CoreGate((6,), str(tmp_path))
    stuck = borrower.borrow(wait_limit_s=1.0)
    assert stuck.__enter__() is True
    try:
        asked = time.monotonic()
        with caplog.at_level("WARNING", logger="worker.core_gate"), owner.step(wait_limit_s=0.3):
            waited = time.monotonic() - asked
        assert 0.3 <= waited < 2.0, waited
        assert "stepping beside it" in caplog.text
    finally:
        stuck.__exit__(None, None, None)
    asked = time.monotonic()
    with owner.step(wait_limit_s=0.3):
        assert time.monotonic() - asked < 0.2  # free again: no wait
    owner.close()
    borrower.close()
