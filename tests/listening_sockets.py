"""The TCP sockets a set of processes listens on, read from Linux ``/proc``."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import NamedTuple

from bench.procfs import pids, stat_fields

PROC = Path("/proc")
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's state column


class Listener(NamedTuple):
    pid: int
    name: str
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int

    def is_loopback(self) -> bool:
        a = self.address
        if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
            a = a.ipv4_mapped
        return a.is_loopback


def _address(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_ip)
    # The kernel prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _listening_inodes() -> dict[int, tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    out = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != LISTEN:
                continue
            hex_ip, hex_port = f[1].split(":")
            out[int(f[9])] = (_address(hex_ip), int(hex_port, 16))
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(PROC / str(pid) / "fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(PROC / str(pid) / "fd" / fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def command_line(pid: int) -> list[str]:
    try:
        return (PROC / str(pid) / "cmdline").read_text(errors="replace").rstrip("\0").split("\0")
    except OSError:
        return []


def session_members(sid: int) -> list[int]:
    """Processes of session ``sid`` (a server started in its own session and everything it started)."""
    return [pid for pid in pids() if (f := stat_fields(pid)) is not None and int(f[3]) == sid]


def listeners(processes: list[int]) -> list[Listener]:
    """Every listening TCP socket held by one of ``processes``."""
    table = _listening_inodes()
    out = []
    for pid in processes:
        name = " ".join(command_line(pid))[:120]
        for inode in _socket_inodes(pid):
            if inode in table:
                out.append(Listener(pid, name, *table[inode]))
    return out
