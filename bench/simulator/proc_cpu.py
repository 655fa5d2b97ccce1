"""CPU seconds used by a running cluster, per role, read from Linux ``/proc``.

A cluster started by ``bucketserve serve`` is one process tree: the serve driver, Ray's own processes (GCS,
raylet, dashboard) and its worker processes, each of which names the actor it hosts (``ray::PrefillWorker``,
``ray::DecodeWorker``, ``ray::ColocatedWorker``) in its command line. :func:`cluster_cpu` sums user + system
CPU per role over that tree; everything that is not a model worker is ``host`` (gateway replica, HTTP proxy,
controller, monitor, Ray).
"""

from __future__ import annotations

import os

from bench.procfs import PROC, pids, stat_fields

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROLES = {"PrefillWorker": "prefill", "DecodeWorker": "decode", "ColocatedWorker": "colocated"}


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid``; None when it is gone."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _role(pid: int) -> str:
    try:
        cmd = (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return "host"
    for actor, role in ROLES.items():
        if f"ray::{actor}" in cmd:
            return role
    return "host"


def process_cpu(root: int) -> dict[int, tuple[str, float]]:
    """Every live process under ``root`` (itself included): pid -> (role, CPU seconds so far)."""
    if not PROC.is_dir():
        raise RuntimeError("per-process CPU needs Linux /proc")
    stats: dict[int, tuple[int, float]] = {}
    for pid in pids():
        if (s := _stat(pid)) is not None:
            stats[pid] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, tuple[str, float]] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in stats and pid not in out:
            out[pid] = (_role(pid), stats[pid][1])
            todo.extend(children.get(pid, ()))
    return out


def cluster_cpu(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds per role between two :func:`process_cpu` snapshots (a process's role is read at the end:
    Ray names a worker process after its actor only once the actor is placed)."""
    out = {"prefill": 0.0, "decode": 0.0, "colocated": 0.0, "host": 0.0}
    for pid, (role, cpu) in after.items():
        out[role] += cpu - before.get(pid, (role, 0.0))[1]
    return {k: round(v, 3) for k, v in out.items()}
