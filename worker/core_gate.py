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
Nothing here knows about requests or Ray.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator

_GATE_DIR = os.path.join(tempfile.gettempdir(), f"bucketserve-cores-{os.getuid()}")


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
    def step(self) -> Iterator[None]:
        """The owner's side, around one step: waits while a borrower holds the cores, holds them for the step."""
        for t in self._turns:
            fcntl.flock(t, fcntl.LOCK_EX)
            fcntl.flock(t, fcntl.LOCK_UN)
        with _held(self._locks):
            yield

    @contextlib.contextmanager
    def borrow(self) -> Iterator[None]:
        """The borrower's side: waits for the owner's step in progress, then holds the cores until the block ends;
        the owner's next step waits for that."""
        with _held(self._turns), _held(self._locks):
            yield

    def close(self) -> None:
        for fd in (*self._locks, *self._turns):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._locks, self._turns = [], []


@contextlib.contextmanager
def _held(fds: list[int]) -> Iterator[None]:
    """Exclusive locks on ``fds`` (in their order, which is core order) for the block."""
    for fd in fds:
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        for fd in reversed(fds):
            fcntl.flock(fd, fcntl.LOCK_UN)
