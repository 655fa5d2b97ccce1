"""What the owner of a core is doing, posted where the other workers of its node can read it without a call.

Colocated workers share cores (``worker/colocated.py``): before a step with a long prompt chunk, a worker looks at
its neighbours' posts to decide whether it may run that step on their cores too. A Ray call per step would cost
more than the decision saves, so each owner writes a small record into a file per core, in the same per-user
directory as the core gates (``worker/core_gate.py``), before every step and whenever it falls idle; a reader takes
it with one ``pread``.

A record says who posted it (a pid: a record of a process that is gone is ignored), how many prompt tokens the
owner still has to compute, how many requests it decodes, and until when (``time.monotonic()``, which is one clock
for every process of the node) its decoding requests can wait without breaking their TPOT targets. The record is
written with one ``pwrite`` and carries its sequence number at both ends, so a reader that raced a write sees a
mismatch and reads again.

Nothing here knows about requests, torch or Ray.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
from dataclasses import dataclass

from worker.core_gate import gate_dir

# seq, pid, prompt tokens, decoding, pause-until (monotonic s; +inf: no limit), seq again
_RECORD = struct.Struct("<qqqqdq")


@dataclass(frozen=True)
class CorePost:
    """One owner's post about its cores."""

    pid: int
    prompt_tokens: int  # prompt tokens it has yet to compute (queued or part-way)
    decoding: int  # requests it decodes
    pause_until: float = math.inf  # its decodes may wait until then (time.monotonic()); inf: no TPOT target

    @property
    def idle(self) -> bool:
        return self.prompt_tokens == 0 and self.decoding == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class CoreBoard:
    """Posts of the owners of ``own`` (written) and of ``watched`` (read), files opened once."""

    def __init__(
        self,
        own: tuple[int, ...] | list[int],
        watched: tuple[int, ...] | list[int],
        directory: str | None = None,
    ) -> None:
        d = directory or gate_dir()
        os.makedirs(d, mode=0o700, exist_ok=True)
        self._seq = 0
        self._own = [self._open(d, c) for c in sorted(set(own))]
        self._watched = {c: self._open(d, c) for c in sorted(set(watched))}

    @staticmethod
    def _open(directory: str, core: int) -> int:
        return os.open(os.path.join(directory, f"core-{core}.post"), os.O_RDWR | os.O_CREAT, 0o600)

    def post(self, prompt_tokens: int, decoding: int, pause_until: float = math.inf) -> None:
        """Post this process's state for each of its own cores."""
        self._seq += 1
        data = _RECORD.pack(self._seq, os.getpid(), prompt_tokens, decoding, pause_until, self._seq)
        for fd in self._own:
            os.pwrite(fd, data, 0)

    def read(self, core: int) -> CorePost | None:
        """The post of ``core``'s owner; None when nobody alive posted there (never, or a process that is gone)."""
        fd = self._watched[core]
        for _ in range(3):
            data = os.pread(fd, _RECORD.size, 0)
            if len(data) < _RECORD.size:
                return None
            seq, pid, prompt, decoding, until, seq2 = _RECORD.unpack(data)
            if seq == seq2:
                return CorePost(pid, prompt, decoding, until) if pid > 0 and _alive(pid) else None
        return None  # written to without pause: taken as busy, not lent

    def clear(self) -> None:
        """Withdraw this process's posts (at shutdown: its cores are no longer anyone's to borrow)."""
        data = _RECORD.pack(0, 0, 0, 0, 0.0, 0)
        for fd in self._own:
            os.pwrite(fd, data, 0)

    def close(self) -> None:
        for fd in (*self._own, *self._watched.values()):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._own, self._watched = [], {}
