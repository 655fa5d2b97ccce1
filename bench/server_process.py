"""A benchmark's server under test: ``bucketserve serve`` (or ``vllm serve``) in its own process session, waited on
until ``/health`` answers, stopped with SIGINT (its clean shutdown) and then whatever of its session is left."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

from bench.procfs import pids, stat_fields

REPO_ROOT = Path(__file__).resolve().parents[1]


# Ports picked here lie above Ray's worker ports (10002-19999 by default) and below the range the kernel hands out
# for outgoing connections and binds to port 0 (ip_local_port_range, 32768-60999 by default): a port free now
# then stays free until the server binds it, where a port the kernel chose could meanwhile go to any process's
# next outgoing connection (a busy Ray cluster opens many).
_PICK_LO, _PICK_HI = 20000, 32767
_PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, outside the kernel's ephemeral range where there is room."""
    hi = min(_PICK_HI, _ephemeral_low() - 1)
    rng = random.SystemRandom()
    for _ in range(200 if hi - _PICK_LO >= 1000 else 0):
        port = rng.randint(_PICK_LO, hi)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in its own process group (session); ``stop`` ends the group and any of its stragglers."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            cwd=str(REPO_ROOT),
            start_new_session=True,
        )
        self.sid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return ""

    def members(self) -> list[int]:
        """Processes still in the server's session (it and everything it started, unless they left it)."""
        return [pid for pid in pids() if (f := stat_fields(pid)) is not None and int(f[3]) == self.sid]

    def stop(self, grace_s: float = 45.0) -> list[int]:
        """SIGINT (its clean shutdown) to the server, SIGKILL to its group when it is not done in ``grace_s``,
        then SIGKILL to whatever of its session is left; returns the pids killed in that last sweep."""
        # The server alone gets the SIGINT: its helpers (Ray's) must stay up while it shuts them down in order.
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.sid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        # Give child processes a moment to follow their parent out, then kill the stragglers.
        deadline = time.monotonic() + 10
        left = self.members()
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = self.members()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        return left


def wait_healthy(base_url: str, server: ServerProcess, timeout_s: float, poll_s: float = 1.0) -> float:
    """Seconds until ``/health`` answers 200; raises RuntimeError when the process dies or time runs out."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not server.alive():
            raise RuntimeError(f"exited with code {server.proc.returncode}: {server.log_tail(600)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        time.sleep(poll_s)
    raise RuntimeError(f"not healthy after {timeout_s:.0f}s: {server.log_tail(600)}")
