"""Who computes on a core of this node: a decode worker steps through its cores' gate, a prefill worker that borrows
those cores holds the gate for its forward pass.

A prefill worker may run a long prompt on the cores of a decode worker beside it while that worker still decodes
(``bucket_manager/lending.py``): the decode worker must then stop stepping for the forward pass, or its thread and the
borrowed OpenMP thread share one core and both crawl (an OpenMP barrier waits on whichever thread the scheduler left
out). Two advisory file locks per core make the hand-over, in a directory of this user on this node:

* ``core-<c>.lock``: held by whoever computes on core ``c``: the decode worker for each step, the borrower for its
  forward pass;
* ``core-<c>.turn``: a turnstile. The borrower takes it first and keeps it; the decode worker passes through it
  (takes it and lets it go) before each step. Without it the decode worker, releasing the core lock and taking it
  again at once, could win every time and starve the borrower; with it the borrower waits for at most the step in
  progress.

Locks are taken in core order (no cycle between two parties), are ``flock`` locks (the kernel drops them when a
process dies, so a crashed borrower blocks nothing) and cost two system calls per lock: about 10 us a decode step.

No wait is unbounded. A healthy party holds a gate for one step or one forward pass (under a second); one that
holds it for ``WAIT_LIMIT_S`` is stuck (a stopped process, a hung step), and waiting on it would stall this worker
and every request it holds. So a borrower that cannot get the cores in that time runs on its own (``borrow``
yields False), and an owner that cannot steps anyway, sharing the core with the stuck party (slow, not stalled);
either logs a warning that names the cores.
Nothing here knows about requests or Ray.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_GATE_DIR = os.path.join(tempfile.gettempdir(), f"bucketserve-cores-{os.getuid()}")
# How long a party waits for a gate before it takes the other for stuck (see the module's docstring).
WAIT_LIMIT_S = 5.0
# Between tries of a held lock: from half a millisecond, doubling to 10 ms, so a wait for a step in progress ends
# within a few milliseconds of it, and a wait through a forward pass of hundreds of milliseconds wakes a few dozen
# times, not a thousand (each wake-up would take the core from the borrower's thread for a moment).
_POLL_FIRST_S = 0.0005
_POLL_MAX_S = 0.01


def gate_dir() -> str:
    return _GATE_DIR


class CoreGate:
    """The gates of ``cores`` (core ids of this node), opened once; empty ``cores``: every method is a no-op."""

    def __init__(self, cores: tuple[int, ...] | list[int], directory: str | None = None) -> None:
        self.cores = tuple(sorted(set(cores)))
        self._locks: list[int] = []
        self._turns: list[int] = []
        if not self.cores:
            return
        d = directory or _GATE_DIR
        os.makedirs(d, mode=0o700, exist_ok=True)
        for c in self.cores:
            self._locks.append(os.open(os.path.join(d, f"core-{c}.lock"), os.O_RDWR | os.O_CREAT, 0o600))
            self._turns.append(os.open(os.path.join(d, f"core-{c}.turn"), os.O_RDWR | os.O_CREAT, 0o600))

    @contextlib.contextmanager
    def step(self, wait_limit_s: float = WAIT_LIMIT_S) -> Iterator[None]:
        """The owner's side, around one step: waits while a borrower holds the cores, holds them for the step (or,
        after ``wait_limit_s``, steps without them)."""
        deadline = time.monotonic() + wait_limit_s
        if _take(self._turns, deadline):
            _release(self._turns)
        if not _take(self._locks, deadline):
            logger.warning(
                "cores %s: held by another process for over %.1f s; stepping beside it",
                self.cores,
                wait_limit_s,
            )
            yield
            return
        try:
            yield
        finally:
            _release(self._locks)

    @contextlib.contextmanager
    def borrow(self, wait_limit_s: float = WAIT_LIMIT_S) -> Iterator[bool]:
        """The borrower's side: waits for the owner's step in progress, then holds the cores until the block ends
        (the owner's next step waits for that) and yields True; False when they were not free within
        ``wait_limit_s``: then the block must run on the borrower's own cores."""
        deadline = time.monotonic() + wait_limit_s
        holder = None if _take(self._turns, deadline) else "another borrower"
        if holder is None and not _take(self._locks, deadline):
            _release(self._turns)
            holder = "their owner"
        if holder is not None:
            logger.warning(
                "cores %s: %s held them for over %.1f s; not borrowing", self.cores, holder, wait_limit_s
            )
            yield False
            return
        try:
            yield True
        finally:
            _release(self._locks)
            _release(self._turns)

    def close(self) -> None:
        for fd in (*self._locks, *self._turns):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._locks, self._turns = [], []


def _take(fds: list[int], deadline: float) -> bool:
    """Exclusive locks on ``fds``, in their order (core order), by ``deadline`` (``time.monotonic()``); False, with
    none of them held, when one stayed held by another party until then."""
    for i, fd in enumerate(fds):
        pause = _POLL_FIRST_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now >= deadline:
                    _release(fds[:i])
                    return False
                time.sleep(min(pause, deadline - now))
                pause = min(2 * pause, _POLL_MAX_S)
    return True


def _release(fds: list[int]) -> None:
    for fd in reversed(fds):
        fcntl.flock(fd, fcntl.LOCK_UN)
