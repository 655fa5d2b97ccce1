"""A worker's compute: the torch threads it runs and the cores it may run on, and cores it borrows for a while.

A worker pins its process to its own cores at start (Linux only). A prefill worker may run one batch on the cores of
idle decode workers beside it (the controller says which, ``bucket_manager/lending.py``), and a colocated worker a
step on its neighbours' (``worker/neighbour_cores.py``): its loop thread widens its own affinity and thread count
for that batch and narrows them again right after the forward pass. OpenMP's
worker threads inherit the affinity of the thread that creates them, so the first widened batch creates them free
to run on the borrowed cores; between borrowed batches they sleep, and the forward runs on the loop thread alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def pin_process(num_threads: int, cpu_affinity: tuple[int, ...]) -> tuple[int, ...]:
    """Give this worker its own compute: torch threads, and the cores it may run on. Returns the cores it is pinned
    to (empty: not pinned: none asked for, none of them usable, or not Linux)."""
    import torch

    torch.set_num_threads(num_threads)
    if cpu_affinity and hasattr(os, "sched_setaffinity"):
        usable = set(range(os.cpu_count() or 1))
        cores = {c for c in cpu_affinity if c in usable}
        if cores:
            os.sched_setaffinity(0, cores)
            return tuple(sorted(cores))
    return ()


def extra_cores(own: tuple[int, ...], borrowed: tuple[int, ...]) -> tuple[int, ...]:
    """The borrowed cores that are not already the worker's own, in the order given."""
    return tuple(c for c in borrowed if c not in own)


@contextlib.contextmanager
def borrowed_cores(own: tuple[int, ...], num_threads: int, borrowed: tuple[int, ...]) -> Iterator[int]:
    """Run the calling thread's torch work on ``own`` plus ``borrowed`` cores, one more thread per borrowed core,
    until the block ends; then back to ``own`` and ``num_threads``. Yields the thread count in use. Nothing changes
    for a worker that is not pinned (``own`` empty), for no core borrowed, or off Linux."""
    import torch

    extra = extra_cores(own, borrowed)
    if not own or not extra or not hasattr(os, "sched_setaffinity"):
        yield num_threads
        return
    try:
        # sched_setaffinity(0) sets the calling thread's affinity (Linux): the loop thread, not the whole process.
        os.sched_setaffinity(0, set(own) | set(extra))
    except OSError as e:  # a core gone offline, a cgroup that narrowed: run on our own
        logger.warning("could not borrow cores %s: %s", extra, e)
        yield num_threads
        return
    torch.set_num_threads(num_threads + len(extra))
    try:
        yield num_threads + len(extra)
    finally:
        torch.set_num_threads(num_threads)
        os.sched_setaffinity(0, set(own))
