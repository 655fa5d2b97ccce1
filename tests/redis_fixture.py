"""A real redis-server for tests: started on a free port in a temp dir, no persistence.

Import the fixture into a test module with `from redis_fixture import redis_server`. A test
that takes Redis away (an outage) starts its own `RedisProcess`, kills it and starts it again
on the same port. A missing binary is a failure, not a skip: the Redis store must be tested
wherever the suite runs.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bench.server_process import free_port

REDIS_SERVER = "redis-server"


def redis_binary() -> str:
    binary = shutil.which(REDIS_SERVER) or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )
    if binary is None:
        pytest.fail(
            "redis-server binary not found on PATH or at /usr/bin/redis-server: install it "
            "(Debian/Ubuntu: apt-get install redis-server) to run the Redis store tests"
        )
    return binary


class RedisProcess:
    """One redis-server; ``start`` picks a free port the first time and reuses it after ``kill``."""

    def __init__(self, workdir: Path, binary: str | None = None) -> None:
        self.workdir = workdir
        self.binary = binary or redis_binary()
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> str:
        # Another process may take a fresh port between choosing and binding it: retry a few times.
        last_error = ""
        for _ in range(5 if self.port is None else 1):
            port = self.port or free_port()
            proc = subprocess.Popen(
                [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
                + ["--dir", str(self.workdir)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            url = f"redis://127.0.0.1:{port}/0"
            client = redis.Redis.from_url(url)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    client.ping()
                    client.close()
                    self.port, self.proc = port, proc
                    return url
                except redis.ConnectionError:
                    time.sleep(0.05)
            client.close()
            if proc.poll() is None:
                proc.kill()
            out = proc.communicate(timeout=5)[0].decode(errors="replace")
            last_error = out[-2000:]
        pytest.fail(f"redis-server did not start (port {self.port or 'free'}); last output:\n{last_error}")

    def kill(self) -> None:
        """SIGKILL: the server is gone at once, with every key (nothing is persisted)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    try:
        yield server.start()
    finally:
        server.stop()
