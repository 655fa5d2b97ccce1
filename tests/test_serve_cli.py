"""``bucketserve serve`` as a user runs it: its start-up output is a few useful lines (one per warmed worker, a
banner with the model, device, dtype, length limit, workers and URLs), free of Ray's notices and relayed progress
bars; polled routes are not access-logged while real requests are; Ctrl-C ends it with a final line and exit 0."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.server_process import ServerProcess, free_port, wait_healthy

pytestmark = pytest.mark.slow


def test_start_up_output_is_quiet_and_useful(tmp_path: Path) -> None:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "tiny",
        "--port",
        str(port),
        "--max-model-len",
        "256",
    ]
    server = ServerProcess(cmd, {"RAY_DEDUP_LOGS": "0"}, tmp_path / "serve.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, server, timeout_s=300)
        for _ in range(3):  # a dashboard polling, a probe, a scraper
            assert httpx.get(f"{base}/dashboard/data", timeout=30).status_code == 200
            assert httpx.get(f"{base}/health", timeout=30).status_code == 200
            assert httpx.get(f"{base}/metrics", timeout=30).status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        time.sleep(3)  # Ray relays the replica's log lines to the driver every few hundred ms
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert server.proc.returncode == 0, log
    lines = log.splitlines()
    banner = next(i for i, line in enumerate(lines) if line.startswith("BucketServe "))
    text = "\n".join(lines[banner : banner + 9])
    assert re.search(r"^BucketServe \S+ ready in \d+\.\ds$", lines[banner]), text
    for needle in (
        "model       'tiny'",
        "engine      cpu, float32, max model len 256, flat shapes",
        "workers     1 prefill + 1 decode (disaggregated, KV over grpc)",
        f"OpenAI API  {base}/v1",
        f"dashboard   {base}/dashboard",
        "Ctrl-C to stop.",
    ):
        assert needle in text, (needle, text)
    # Before the banner: our own lines, one per warmed worker, and nothing of Ray's start-up chatter.
    before = "\n".join(lines[:banner])
    assert len(re.findall(r"\[\d/2\] bucketserve:(prefill|decode)-0 warmed in", before)) == 2, before
    for noise in ("Token authentication", "Started a local Ray instance", "Connecting to existing Serve app"):
        assert noise not in log, noise
    assert "it/s]" not in log, "a progress bar was relayed"
    # Real requests are access-logged; polled routes are not.
    assert "POST /v1/completions 200" in log, log[-3000:]
    for polled in ("GET /dashboard/data", "GET /health", "GET /metrics"):
        assert polled not in log, polled
    assert lines[-2:] == ["stopping...", "stopped."], lines[-6:]
    assert "graceful_shutdown failed" not in log
