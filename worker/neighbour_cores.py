"""Colocated workers of one node lend each other their cores for long prompt chunks.

Two colocated workers on a 2-core host each run one engine on one core. A long prompt then prefills on one core
while the other worker may have nothing to do, or only a few requests to decode: on `small` a 1,500-token prompt
takes about 1.05 s on one core and 0.53 s on two, so a TTFT target that two cores meet is missed. The disaggregated
cluster lends the decode worker's core to the prefill worker (``bucket_manager/lending.py``); this is the same for
colocated workers, decided by the worker about to step, from what its neighbours post (``worker/core_board.py``):

* before every step (and whenever it falls idle) a worker posts the prompt tokens it has yet to compute, how many
  requests it decodes, and until when those can wait (the TPOT guard's allowance: ``LLMEngine.tpot_allowance_s``);
* a step with a long enough prompt chunk runs on every idle neighbour's cores too, and on those of neighbours
  that only decode when its most urgent prompt would miss its TTFT target otherwise and they have the room
  (``bucket_manager/lending.colocated_borrow``); a neighbour with prompt work of its own keeps its cores;
* each step holds its cores' gates (``worker/core_gate.py``): a worker's own for a plain step, its own and the
  borrowed ones for a widened step, so the neighbour does not step on a core lent for that step and the borrower
  waits for at most the neighbour's step in progress. A widened step takes the gates of all its cores in core
  order, as one borrower: two workers that widen at once queue on the turnstiles instead of deadlocking.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from bucket_manager.lending import Neighbour, colocated_borrow, widened_s
from worker.core_board import CoreBoard
from worker.core_gate import CoreGate
from worker.cores import borrowed_cores

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.request import Request

logger = logging.getLogger(__name__)

# A step with fewer prompt tokens than this runs on the worker's own cores: it is short on one core already (128
# tokens of `small` take ~70 ms there) and two threads gain less on it.
MIN_BORROW_TOKENS = 128


class NeighbourCores:
    """The engine's ``compute_cores`` of a colocated worker pinned to ``own`` cores, with neighbours on
    ``neighbours`` (cores of the other colocated workers of its node). ``max_pause_s``: the longest a step may
    pause a neighbour that decodes (0: only idle neighbours lend)."""

    def __init__(
        self,
        engine: LLMEngine,
        own: tuple[int, ...],
        num_threads: int,
        neighbours: tuple[tuple[int, str], ...],
        max_pause_s: float,
    ) -> None:
        self.engine = engine
        self.own = own
        self.num_threads = num_threads
        self.owners = {c: worker for c, worker in neighbours if c not in own}  # core -> its worker's id
        self.neighbours = tuple(sorted(self.owners))
        self.max_pause_s = max_pause_s
        self.board = CoreBoard(own, self.neighbours)
        self._gate = CoreGate(own)
        self._gates: dict[tuple[int, ...], CoreGate] = {}  # own + borrowed cores -> their gate, opened once
        self.widened_steps = 0
        self.pausing_steps = 0  # of those, steps that paused a neighbour that was decoding
        # Neighbours whose cores a step ran on since the last take_lenders() (each once per step), for the monitor.
        self._lenders: list[str] = []
        self.post()

    # ------------------------------------------------------------------ posts
    def post(self) -> None:
        """Post what this worker has to do (before each step, and when it falls idle or takes a request)."""
        e = self.engine
        prompt = sum(r.num_tokens - r.num_computed_tokens for r in e.waiting)
        decoding = 0
        for r in e.running:
            left = r.num_tokens - r.num_computed_tokens
            if left > 1 or r.num_generated_tokens == 0:
                prompt += left
            else:
                decoding += 1
        now = time.monotonic()
        allowance = e.tpot_allowance_s(now) if decoding else None
        step = e.step_clock.decode_step_s or 0.0
        until = math.inf if allowance is None else now + allowance - step
        self.board.post(prompt, decoding, until)

    # ------------------------------------------------------------------ the engine's hook
    @contextlib.contextmanager
    def __call__(self, items: Sequence[tuple[Request, int]]) -> Iterator[float]:
        self.post()
        borrow = self._borrow(items)
        if not borrow:
            with self._gate.step():
                yield 1.0
            return
        key = tuple(sorted(set(self.own) | set(borrow)))
        gate = self._gates.get(key)
        if gate is None:
            gate = self._gates[key] = CoreGate(key)
        with gate.borrow() as held:
            if not held:  # a neighbour stuck holding its core: this step on its own cores, as any other
                with self._gate.step():
                    yield 1.0
                return
            with borrowed_cores(self.own, self.num_threads, borrow) as threads:
                if threads > self.num_threads:
                    self.widened_steps += 1
                    self._lenders.extend(dict.fromkeys(self.owners[c] for c in borrow))
                # 1.0 when nothing was widened
                yield widened_speedup(len(self.own), threads - self.num_threads)

    def _borrow(self, items: Sequence[tuple[Request, int]]) -> tuple[int, ...]:
        """The neighbours' cores this step runs on too (empty: its own only)."""
        if not self.neighbours:
            return ()
        prompt = 0
        urgent: Request | None = None
        for r, n in items:
            if n > 1 or r.num_generated_tokens == 0:
                prompt += n
                if r.slo_ttft_ms is not None and (urgent is None or _deadline(r) < _deadline(urgent)):
                    urgent = r
        if prompt < MIN_BORROW_TOKENS:
            return ()
        live = [(c, p) for c in self.neighbours if (p := self.board.read(c)) is not None]
        cores = [c for c, _ in live]
        now = time.monotonic()
        hood = [Neighbour(p.prompt_tokens, p.decoding, p.pause_until - now) for _, p in live]
        clock = self.engine.step_clock
        pace = clock.prompt_s_per_token or 0.0
        decode_s = clock.decode_step_s or 0.0
        step_s = prompt * pace + (decode_s if len(items) > 1 else 0.0)
        if urgent is not None:
            remaining_s = (urgent.num_tokens - urgent.num_computed_tokens) * pace + decode_s
            slack_s = _deadline(urgent) - now
        else:
            remaining_s, slack_s = 0.0, math.inf
        chosen = colocated_borrow(
            prompt,
            step_s if pace else 0.0,
            remaining_s if pace else 0.0,
            slack_s,
            len(self.own),
            hood,
            self.max_pause_s,
            MIN_BORROW_TOKENS,
        )
        if any(hood[i].decoding for i in chosen):
            self.pausing_steps += 1
        return tuple(cores[i] for i in chosen)

    def take_lenders(self) -> list[str]:
        """The neighbours (worker ids) that lent their cores to a step since the last call, once per step."""
        lenders, self._lenders = self._lenders, []
        return lenders

    def close(self) -> None:
        self.board.clear()
        self.board.close()
        self._gate.close()
        for gate in self._gates.values():
            gate.close()


def _deadline(r: Request) -> float:
    """A request's TTFT deadline on ``time.monotonic()``'s clock (its arrival is on that clock)."""
    return r.arrival_time + (r.slo_ttft_ms or 0.0) / 1e3


def widened_speedup(own: int, borrowed: int) -> float:
    """How much faster a forward runs on ``own`` plus ``borrowed`` cores than on ``own`` (the step clock divides
    it out, so its estimates stay those of the worker's own cores)."""
    return 1.0 / widened_s(1.0, own, borrowed)
