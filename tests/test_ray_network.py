"""Where Ray and the gateway listen: the warnings of ``bucketserve serve`` when a cluster it joins runs without Ray's
token authentication, or its HTTP gateway listens beyond loopback without an API key. (That a local cluster
listens on loopback only is checked on a real ``bucketserve serve`` in ``test_serve_cli.py``.)"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from gateway.ray_network import is_loopback, warn_if_open_http


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.0.2.7", False),
        ("gateway.example", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_an_open_http_gateway_without_an_api_key_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.ray_network"):
        warn_if_open_http("127.0.0.1", None)
        warn_if_open_http("0.0.0.0", "a-key")
        assert caplog.records == []
        warn_if_open_http("0.0.0.0", None)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "0.0.0.0 without an API key" in record.getMessage() and "\n" not in record.getMessage()


WARN_SCRIPT = """
import logging
logging.basicConfig(format="%(levelname)s %(message)s")
from gateway.ray_network import warn_unless_token_auth
warn_unless_token_auth("10.1.2.3:6379")
"""


@pytest.mark.parametrize("mode", ["disabled", "token"])
def test_joining_a_cluster_without_token_authentication_is_warned_about(mode: str) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": mode}
    out = subprocess.run(
        [sys.executable, "-c", WARN_SCRIPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "token authentication" in line]
    if mode == "token":
        assert lines == [], out.stderr
    else:
        assert len(lines) == 1 and lines[0].startswith("WARNING Ray cluster 10.1.2.3:6379 runs without"), (
            out.stderr
        )
