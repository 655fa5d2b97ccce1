"""Linux ``/proc``: the processes there and the fields of each one's ``stat`` line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

PROC = Path("/proc")


def pids() -> Iterator[int]:
    """Every process id listed in ``/proc`` now."""
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def stat_fields(pid: int) -> list[str] | None:
    """The ``stat`` fields after the command name: ``[state, ppid, pgrp, session, ..., utime (11), stime (12),
    ...]``; None when the process is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after its closing one.
    return text[text.rindex(")") + 2 :].split()
