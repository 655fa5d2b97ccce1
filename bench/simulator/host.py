"""Host CPU contention: the workers and the serving path share a machine's cores.

The engine calibration times each step alone. In a running cluster on a small host, the same cores also run
the gateway, the HTTP proxy, the controller and the benchmark client, whose work grows with the tokens
streamed, so every step stretches as the load rises. :class:`HostModel` states that load: how many cores
the cluster shares, the host CPU each streamed token and each request costs, and how much CPU a worker burns
per second of engine time (its Python, RPC and KV-transfer work around the forward). :class:`SharedCpu`
applies it in the simulation as processor sharing: every runnable entity (a busy worker, the host when it
has work) gets an equal share of the cores, at most one core each, and each piece of work finishes when its
CPU seconds are served. The figures come from a measurement of the running cluster (``validate.py``
measures per-process CPU with :mod:`bench.simulator.proc_cpu` under a calibration load), not from a fit to
attainment.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HOST = "host"


@dataclass(frozen=True)
class HostModel:
    cores: float
    host_token_cpu_s: float = 0.0  # gateway + proxy + client CPU per streamed token
    host_request_cpu_s: float = 0.0  # ... per request (parsing, tokenizing, routing)
    prefill_cpu_factor: float = 1.0  # prefill worker CPU seconds per second of calibrated engine time
    decode_cpu_factor: float = 1.0  # decode worker CPU seconds ...
    source: str = ""

    def __post_init__(self) -> None:
        if self.cores <= 0:
            raise ValueError(f"HostModel.cores must be > 0, got {self.cores}")
        for name in ("host_token_cpu_s", "host_request_cpu_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"HostModel.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("prefill_cpu_factor", "decode_cpu_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HostModel.{name} must be > 0, got {getattr(self, name)}")


class SharedCpu:
    """Processor sharing of ``cores`` among entities, on a simulator's clock.

    ``schedule(t, fn, *args)`` puts an event on the simulator's queue, ``clock()`` reads its time. Each
    entity (a key) runs one piece of work at a time; the host is a FIFO of pieces under the key ``HOST``.
    """

    def __init__(self, cores: float, clock: Callable[[], float], schedule: Callable[..., None]) -> None:
        self.cores = cores
        self._clock = clock
        self._schedule = schedule
        self._jobs: dict[Any, list] = {}  # key -> [remaining CPU s, fn, args]
        self._host: deque = deque()  # (work, fn, args) waiting behind the host's current piece
        self._last = 0.0
        self._gen = 0
        self.busy_s: dict[Any, float] = {}  # CPU seconds served per key

    def _rate(self) -> float:
        n = len(self._jobs)
        return min(1.0, self.cores / n) if n else 0.0

    def _advance(self) -> None:
        now = self._clock()
        served = (now - self._last) * self._rate()
        if served > 0:
            for key, job in self._jobs.items():
                job[0] -= served
                self.busy_s[key] = self.busy_s.get(key, 0.0) + served
        self._last = now

    def _reschedule(self) -> None:
        self._gen += 1
        if not self._jobs:
            return
        remaining = min(job[0] for job in self._jobs.values())
        self._schedule(self._clock() + max(0.0, remaining) / self._rate(), self._fire, self._gen)

    def run(self, key: Any, work_s: float, fn: Callable[..., None], *args: Any) -> None:
        """Start ``work_s`` CPU seconds on ``key`` (which must be idle); ``fn(*args)`` when served."""
        if key in self._jobs:
            raise RuntimeError(f"{key} is already running work")
        self._advance()
        self._jobs[key] = [work_s, fn, args]
        self._reschedule()

    def host(self, work_s: float, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``work_s`` CPU seconds of host work; ``fn(*args)`` once it and everything before it is done."""
        if HOST in self._jobs:
            self._host.append((work_s, fn, args))
        else:
            self.run(HOST, work_s, fn, *args)

    def _fire(self, gen: int) -> None:
        if gen != self._gen:
            return  # superseded: the set of runnable entities changed since this was scheduled
        self._advance()
        # The piece that was nearest to done is done now; others within rounding of zero are done too.
        first = min(self._jobs, key=lambda k: self._jobs[k][0])
        done = [k for k, job in self._jobs.items() if k == first or job[0] <= 1e-12]
        calls = [(k, self._jobs.pop(k)) for k in done]
        if HOST in done and self._host:
            work, fn, args = self._host.popleft()
            self._jobs[HOST] = [work, fn, args]
        self._reschedule()
        for _, (_, fn, args) in calls:
            fn(*args)
