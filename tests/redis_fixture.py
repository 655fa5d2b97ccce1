"""A real redis-server for tests: started on a free port in a temp dir, no persistence.

Import the fixture into a test module with `from redis_fixture import redis_server`.
A missing binary is a failure, not a skip: the Redis store must be tested wherever the
suite runs.
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


def _start(binary: str, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    # Another process may take the port between choosing and binding it: retry a few times.
    last_error = ""
    for _ in range(5):
        port = free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--dir", str(workdir)],
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
                return proc, url
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=5)[0].decode(errors="replace")
        last_error = out[-2000:]
    pytest.fail(f"redis-server did not start on a free port after 5 tries; last output:\n{last_error}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which(REDIS_SERVER) or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )
    if binary is None:
        pytest.fail(
            "redis-server binary not found on PATH or at /usr/bin/redis-server: install it "
            "(Debian/Ubuntu: apt-get install redis-server) to run the Redis store tests"
        )
    proc, url = _start(binary, tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
