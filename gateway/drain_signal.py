"""How ``bucketserve serve`` drains its gateway replicas: a named Ray actor that every replica follows.

Ray Serve routes each call to one replica of its choosing, so a handle cannot reach them all. Instead each
replica registers with this actor when it starts and keeps one call waiting on it; the stopping process calls
``start(timeout_s)``, which answers every waiting call at once, each replica drains (``gateway/drain.py``) and
reports back, and the process waits for those reports before it deletes the app and stops the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from dataclasses import asdict

import ray
from ray.actor import ActorHandle

from gateway.drain import Drain

logger = logging.getLogger(__name__)

# Beyond the drain period: time for the replicas' aborts to land and their reports to arrive.
REPORT_MARGIN_S = 10.0


class DrainSignal:
    """The drain's go signal and the replicas' reports (an async actor: every waiting call is a coroutine)."""

    def __init__(self) -> None:
        self._go = asyncio.Event()
        self._timeout_s = 0.0
        self._replicas: set[str] = set()
        self._reports: dict[str, dict] = {}
        self._all_reported = asyncio.Event()

    async def register(self, replica: str) -> None:
        self._replicas.add(replica)

    async def wait_start(self) -> float:
        """Returns the drain period once the drain starts."""
        await self._go.wait()
        return self._timeout_s

    async def start(self, timeout_s: float) -> int:
        """Start the drain on every replica; returns how many are registered."""
        self._timeout_s = timeout_s
        self._go.set()
        self._check_all()
        return len(self._replicas)

    async def report(self, replica: str, report: dict) -> None:
        self._reports[replica] = report
        self._check_all()

    def _check_all(self) -> None:
        if self._replicas <= set(self._reports):
            self._all_reported.set()

    async def wait_reports(self, timeout_s: float) -> dict:
        """Every registered replica's report, or those that came within ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_reported.wait(), timeout_s)
        return {"replicas": len(self._replicas), "reports": list(self._reports.values())}


# ----------------------------------------------------------------------------------- the stopping process


def launch(name: str, namespace: str) -> ActorHandle[DrainSignal]:
    """Start the signal actor (before the gateway replicas, which look it up by name when they start). Not waited
    for: a named actor's name is registered before ``remote()`` returns, and calls made while its process starts
    wait for it, so the workers' start-up need not wait behind this one's."""
    return ray.remote(DrainSignal).options(name=name, namespace=namespace, num_cpus=0).remote()


def drain_replicas(signal: ActorHandle[DrainSignal], timeout_s: float, force: threading.Event) -> str:
    """Drain every replica and wait for their reports; returns one line saying how it went. ``force`` (a second
    Ctrl-C) stops waiting."""
    t0 = time.monotonic()
    ray.get(signal.start.remote(timeout_s), timeout=30)
    ref = signal.wait_reports.remote(timeout_s + REPORT_MARGIN_S)
    while not ray.wait([ref], timeout=0.2)[0]:
        if force.is_set():
            return "stopping now: open requests are cut"
    result = ray.get(ref)
    reports = result["reports"]
    took = time.monotonic() - t0
    finished = sum(r["finished"] for r in reports)
    cut = sum(r["cut"] for r in reports)
    missing = result["replicas"] - len(reports)
    line = f"drained in {took:.1f}s: {finished} open request(s) finished"
    if cut:
        line += f", {cut} ended with an error at the end of the {timeout_s:g}s drain period"
    if missing:
        line += f"; {missing} gateway replica(s) did not report"
    return line


# ----------------------------------------------------------------------------------- each gateway replica


class DrainFollower:
    """A gateway replica's side: registered at start, then one call waiting for the drain to start."""

    def __init__(self, address: tuple[str, str]) -> None:
        namespace, name = address
        self.replica = uuid.uuid4().hex[:12]
        self._task: asyncio.Task | None = None
        self._signal: ActorHandle[DrainSignal] | None = None
        try:
            signal = ray.get_actor(name, namespace=namespace)
            ray.get(signal.register.remote(self.replica), timeout=30)
            self._signal = signal
        except Exception as e:  # serve without a drain rather than not at all
            logger.warning(
                "no drain signal %r (%s: %s): this replica will not drain", name, type(e).__name__, e
            )

    def follow(self, drain: Drain) -> None:
        """Start following (on the replica's event loop)."""
        if self._signal is not None:
            self._task = asyncio.get_running_loop().create_task(self._follow(self._signal, drain))

    async def _follow(self, signal: ActorHandle[DrainSignal], drain: Drain) -> None:
        try:
            timeout_s = await signal.wait_start.remote()
        except Exception as e:  # the stopping process is gone: nobody will ask for a drain
            logger.warning("drain signal lost: %s: %s", type(e).__name__, e)
            return
        report = await drain.run(timeout_s)
        await signal.report.remote(self.replica, asdict(report))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
