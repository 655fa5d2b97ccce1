"""``bucketserve serve`` as a user runs it: its start-up output is a few useful lines (one per warmed worker, a
banner with the model, device, dtype, length limit, workers and URLs), free of Ray's notices and relayed progress
bars; polled routes are not access-logged while real requests are; the local Ray cluster it starts listens on
loopback only; Ctrl-C ends it with a final line and exit 0."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from gateway_helpers import sse_events
from listening_sockets import command_line, listeners, session_members
from prometheus_client.parser import text_string_to_metric_families

from bench.server_process import ServerProcess, free_port, wait_healthy

pytestmark = pytest.mark.slow


def serve_tiny(port: int, *extra: str, max_model_len: int = 256) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "tiny",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        *extra,
    ]


def test_start_up_output_is_quiet_and_useful(tmp_path: Path) -> None:
    port = free_port()
    server = ServerProcess(serve_tiny(port), {"RAY_DEDUP_LOGS": "0"}, tmp_path / "serve.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, server, timeout_s=300)
        check_ray_listens_on_loopback_only(server)
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
    for noise in (
        "Token authentication",
        "Started a local Ray instance",
        "Connecting to existing Serve app",
        "monitor figures are",  # the monitor's first answer is not late while the cluster starts
        "DeprecationWarning",
        "Use get_actor_id() instead",
    ):
        assert noise not in log, noise
    assert "it/s]" not in log, "a progress bar was relayed"
    # Real requests are access-logged; polled routes are not.
    assert "POST /v1/completions 200" in log, log[-3000:]
    for polled in ("GET /dashboard/data", "GET /health", "GET /metrics"):
        assert polled not in log, polled
    assert lines[-2:] == ["stopping...", "stopped."], lines[-6:]
    assert "graceful_shutdown failed" not in log
    assert "without an API key" not in log and "without token authentication" not in log


# A driver of its own on the server's cluster, asking Ray where its nodes are. A cluster on loopback is one
# machine's: Ray's switch for that lets this driver's node address be loopback too; the server's cluster
# authenticates with the token it wrote to ~/.ray/auth_token.
NODES_SCRIPT = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(json.dumps([n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]))
"""


def check_ray_listens_on_loopback_only(server: ServerProcess) -> None:
    """Every TCP socket the server's processes listen on (Ray's GCS, raylet, agents, workers, Serve's proxy,
    the KV transfer) is bound to 127.0.0.1, and Ray gives the node's address as 127.0.0.1."""
    members = session_members(server.sid)
    found = listeners(members)
    names = " ".join(listener.name for listener in found)
    for part in ("raylet", "gcs_server", "DashboardAgent", "DecodeWorker"):
        assert part in names, (part, found)
    assert [listener for listener in found if not listener.is_loopback()] == [], found
    gcs = next(
        arg.split("=", 1)[1]
        for pid in members
        for arg in command_line(pid)
        if arg.startswith("--gcs-address=")
    )
    assert gcs.startswith("127.0.0.1:"), gcs
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
    out = subprocess.run(
        [sys.executable, "-c", NODES_SCRIPT, gcs], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["127.0.0.1"], out.stdout


def test_direct_ingress_answers_on_the_port_from_the_replica(tmp_path: Path, hf_reference) -> None:
    """``--direct-ingress on``: the gateway replica itself listens on --port (Serve's proxy elsewhere, unused); greedy
    completions, streamed and not, equal Hugging Face's; Ctrl-C still drains and stops cleanly."""
    port = free_port()
    # Room for a long answer: the disconnect below must come while the request still decodes.
    server = ServerProcess(
        serve_tiny(port, "--direct-ingress", "on", max_model_len=1024), {}, tmp_path / "serve.log"
    )
    base = f"http://127.0.0.1:{port}"
    prompt = [17, 300, 42, 9, 1000, 5]
    try:
        wait_healthy(base, server, timeout_s=300)
        found = listeners(session_members(server.sid))
        on_port = [listener.name for listener in found if listener.port == port]
        assert len(on_port) == 1 and "ServeReplica" in on_port[0], found
        assert any("ProxyActor" in listener.name for listener in found), found  # moved, not gone
        for stream in (False, True):
            body = {
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
                "stream": stream,
            }
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            if stream:
                events = sse_events(r.text.splitlines())
                assert events[-1] == "[DONE]", r.text[-300:]
                labels = [
                    t
                    for e in events[:-1]
                    if e["choices"][0]["logprobs"]
                    for t in e["choices"][0]["logprobs"]["tokens"]
                ]
            else:
                labels = r.json()["choices"][0]["logprobs"]["tokens"]
            ids = [int(t.removeprefix("token_id:")) for t in labels]
            assert ids == hf_reference("tiny", "cpu").greedy(prompt, 8, ignore_eos=True), stream
        bad = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": "ten"}, timeout=30)
        assert bad.status_code == 400 and "max_tokens" in bad.text, bad.text
        # A client that goes away mid-stream frees its KV (Serve's own server sees the disconnect, not its proxy).
        # A 960-token answer decodes for seconds here. The KV is read while the stream is still open: leaving the
        # loop over `iter_lines()` closes the connection, and the workers report their KV only every 0.5 s.
        long = {"prompt": list(range(100, 160)), "max_tokens": 960, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{base}/v1/completions", json=long) as r:
            assert r.status_code == 200
            stream_lines = r.iter_lines()
            seen = 0
            while seen < 5:
                seen += next(stream_lines).startswith("data: ")
            deadline = time.monotonic() + 3
            while not sum(kv_used(base).values()) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert sum(kv_used(base).values()) > 0, "the request should hold KV while it streams"
            stream_lines.close()  # the client goes away
        deadline = time.monotonic() + 20
        while sum(kv_used(base).values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert sum(kv_used(base).values()) == 0, kv_used(base)
        families = text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text)
        aborted = [
            sample
            for family in families
            for sample in family.samples
            if sample.name == "bucketserve:request_failure_total"
            and sample.labels["finished_reason"] == "abort"
        ]
        # One series per priority class: the request is counted in exactly one of them.
        assert sum(sample.value for sample in aborted) == 1, (
            f"the request should end aborted, not finish: {aborted}"
        )
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert server.proc.returncode == 0, log[-3000:]
    # Ray relays the replica's access log lines late: they may come between these two.
    lines = log.splitlines()
    assert lines[-1] == "stopped." and "stopping..." in lines, log[-2000:]


def kv_used(base: str) -> dict[str, int]:
    """KV blocks in use per worker, as the dashboard's data reports them (the workers' heartbeats)."""
    return {
        w["worker_id"]: w["kv_blocks_used"]
        for w in httpx.get(f"{base}/dashboard/data", timeout=30).json()["workers"]
    }
