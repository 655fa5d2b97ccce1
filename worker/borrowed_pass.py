"""A prefill forward pass on borrowed cores that gives them back between layers once their owner wants them.

A prefill worker may run a batch on the cores of an idle decode worker beside it (``bucket_manager/lending.py``).
When the controller then lends that decode worker a short prompt of its own, the decode worker's step asks for its
cores (``CoreGate.step(want=True)``). Without this, the short prompt would wait for the whole of the long pass (about
a second for a 2,000-token prompt on a small CPU host); with it, it waits for one layer: the pass looks after every
layer, narrows its threads to its own cores and lets the borrowed ones go, and runs its remaining layers there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from worker.core_gate import CoreGate
from worker.cores import narrow_to_own

logger = logging.getLogger(__name__)


class BorrowedPass:
    """One forward pass's hold on borrowed cores. ``then``: the pass's own per-layer hook (KV streaming), run
    first; ``speedup``: how much faster the pass runs widened than on ``own`` alone (the controller's estimate, which
    :meth:`widened_equivalent_s` applies to the part run on ``own`` alone)."""

    def __init__(
        self,
        gate: CoreGate,
        own: tuple[int, ...],
        num_threads: int,
        speedup: float,
        then: Callable[[int], None] | None = None,
    ) -> None:
        self._gate = gate
        self._own = own
        self._num_threads = num_threads
        self._speedup = speedup
        self._then = then
        self.started = time.perf_counter()
        self.given_back_at: float | None = None  # perf_counter seconds; None while the cores are held
        self.given_back_after_layer: int | None = None

    def on_layer_written(self, layer: int) -> None:
        if self._then is not None:
            self._then(layer)
        if self.given_back_at is None and self._gate.wanted():
            # Threads off the borrowed cores first: the owner steps there as soon as the lock is free.
            narrow_to_own(self._own, self._num_threads)
            self._gate.give_back()
            self.given_back_at = time.perf_counter()
            self.given_back_after_layer = layer
            logger.debug("gave cores %s back to their owner after layer %d", self._gate.cores, layer)

    def widened_equivalent_s(self, forward_s: float) -> float:
        """The seconds the pass (``forward_s``) would have taken widened throughout: the controller paces a batch
        that borrowed cores as a widened one. A pass that gave the cores back ran its last part on its own."""
        if self.given_back_at is None:
            return forward_s
        widened = max(0.0, min(forward_s, self.given_back_at - self.started))
        return widened + (forward_s - widened) / self._speedup
