"""Two Ray nodes on one machine (a head, on the address Ray gives it, and a node on 127.0.0.2, each with a custom
resource of its own): prefill is placed on one and decode on the other by ``--prefill-resources`` /
``--decode-resources``, the decode worker listens on every address and advertises its node's, and KV crosses
between them over gRPC with TLS and the cluster's token, not shared memory. Completions equal Hugging Face greedy, token for token.

The head, the second node and ``bucketserve serve --address`` are the real command-line tools, each in its own
process session; Ray's token authentication is on for both nodes and every client."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from gateway_helpers import greedy_completions
from prometheus_client.parser import text_string_to_metric_families
from ray_nodes import BIN, cluster_env, start_node, stop_node
from test_kv_grpc import _self_signed

from bench.server_process import ServerProcess, free_port, wait_healthy

pytestmark = pytest.mark.slow

HEALTHY_TIMEOUT_S = 300.0
PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog and then", "1 2 3 4 5 " * 12]
MAX_TOKENS = [8, 12, 6]

# Run as a driver of the test's cluster (the test process may already hold a Ray session of its own): where
# each worker runs, and how the prefill worker reaches its decode peer.
# A Serve application of someone else's on the cluster, with its proxy on argv[2].
OTHER_APP = """
import sys, ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
@serve.deployment
def other(request):
    return "other"
serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[2])})
serve.run(other.bind(), name="other", route_prefix="/other")
"""

DELETE_OTHER_APP = """
import sys, ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
serve.delete("other")
"""

PROBE = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace="bucketserve", logging_level="ERROR", log_to_driver=False)
node_resources = {n["NodeID"]: sorted(n["Resources"]) for n in ray.nodes() if n["Alive"]}
out = {}
for role in ("prefill", "decode"):
    actor = ray.get_actor(f"bucketserve:{role}-0", namespace="bucketserve")
    node, ip = ray.get(actor.__ray_call__.remote(
        lambda _: (__import__("ray").get_runtime_context().get_node_id(), __import__("ray").util.get_node_ip_address())
    ))
    out[role] = {"node_resources": node_resources[node], "node_ip": ip, "stats": ray.get(actor.stats.remote())}
print(json.dumps(out, default=str))
"""


def test_prefill_and_decode_on_two_nodes_kv_over_the_network(tmp_path: Path, hf_reference) -> None:
    ray_tmp = Path(tempfile.mkdtemp(prefix="bsmn-", dir="/tmp"))
    env = cluster_env()
    head_port = free_port()
    address = f"127.0.0.1:{head_port}"
    cert, key = _self_signed(tmp_path, san="DNS:bucketserve-kv")
    nodes = []
    serve = None
    try:
        nodes.append(
            start_node(
                env, ray_tmp, tmp_path / "head.log", head_port=head_port, resources={"prefill_node": 1}
            )
        )
        nodes.append(
            start_node(
                env,
                ray_tmp,
                tmp_path / "node2.log",
                address=address,
                node_ip="127.0.0.2",
                resources={"decode_node": 1},
            )
        )
        http_port = free_port()
        cmd = [
            str(BIN / "bucketserve"),
            "serve",
            "--model",
            "tiny",
            "--address",
            address,
            "--port",
            str(http_port),
        ]
        cmd += ["--prefill-resources", '{"prefill_node": 1}', "--decode-resources", '{"decode_node": 1}']
        cmd += ["--kv-host", "0.0.0.0", "--kv-tls-cert", cert, "--kv-tls-key", key]
        cmd += ["--kv-tls-server-name", "bucketserve-kv", "--no-kv-same-node-shm"]
        cmd += ["--max-model-len", "256", "--worker-num-cpus", "1", "--no-pin-cores"]
        serve = ServerProcess(cmd, env, tmp_path / "serve.log")
        base = f"http://127.0.0.1:{http_port}"
        wait_healthy(base, serve, HEALTHY_TIMEOUT_S)

        results = greedy_completions(base, PROMPTS, MAX_TOKENS, timeout=120)
        hf = hf_reference("tiny", "cpu")
        for prompt, n, res in zip(PROMPTS, MAX_TOKENS, results, strict=True):
            got = [int(t.removeprefix("token_id:")) for t in res["choices"][0]["logprobs"]["tokens"]]
            assert got == hf.greedy(hf.tokenizer(prompt).input_ids, n), prompt

        probe = subprocess.run(
            [str(BIN / "python"), "-c", PROBE, address], env=env, capture_output=True, text=True, timeout=120
        )
        assert probe.returncode == 0, probe.stderr[-2000:]
        where = json.loads(probe.stdout.strip().splitlines()[-1])
        # Each role on the node offering its resource (the head, on the machine's address, and 127.0.0.2).
        assert "prefill_node" in where["prefill"]["node_resources"], where["prefill"]["node_resources"]
        assert "decode_node" in where["decode"]["node_resources"], where["decode"]["node_resources"]
        assert where["decode"]["node_ip"] == "127.0.0.2" != where["prefill"]["node_ip"], where
        # The decode worker advertised its own node's address, and the prefill worker reached it over the
        # network path (gRPC with TLS), not shared memory.
        routes = where["prefill"]["stats"]["transport"]["routes"]
        assert list(routes.values()) == ["grpc+tls"] and next(iter(routes)).startswith("127.0.0.2:"), routes
        sent = where["prefill"]["stats"]["transport"]
        assert sent["bytes_sent"] > 0, sent
        # ... and /metrics counts those bytes under that transport (workers report on their heartbeat).
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(base + "/metrics", timeout=10).text
            kv = {
                s.labels["transport"]: s.value
                for f in text_string_to_metric_families(text)
                if f.name == "bucketserve:kv_transfer_bytes"
                for s in f.samples
            }
            if kv.get("grpc+tls", 0) > 0:
                break
            assert time.monotonic() < deadline, kv
            time.sleep(0.5)
        assert set(kv) == {"grpc+tls"}, kv
        serve.stop(grace_s=30)
        serve = None
        # Serve on a cluster it joined is shut down with it: its proxy does not keep holding the port.
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", http_port), timeout=5).close()

        # Resources no node offers: refused before any worker starts, naming the key and what the nodes offer.
        bad = [str(BIN / "bucketserve"), "serve", "--model", "tiny", "--address", address]
        bad += [
            "--port",
            str(free_port()),
            "--prefill-resources",
            '{"gaudi_node": 1}',
            "--max-model-len",
            "256",
        ]
        refused = subprocess.run(bad, env=env, capture_output=True, text=True, timeout=180)
        err = refused.stderr[-3000:]
        assert refused.returncode == 1, err
        assert "differs from the existing one" not in err, err  # a fresh Serve, on this --port
        assert "no node of the Ray cluster offers prefill_resources {'gaudi_node': 1.0}" in err, err
        assert "prefill_node 1" in err and "decode_node 1" in err, err

        # Another application's Serve on another port: refused at once (it would ignore --port), naming both.
        other_port, ours_port = free_port(), free_port()
        other = [str(BIN / "python"), "-c", OTHER_APP, address, str(other_port)]
        started = subprocess.run(other, env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stderr[-2000:]
        clash = [str(BIN / "bucketserve"), "serve", "--model", "tiny", "--address", address]
        clash += ["--port", str(ours_port), "--max-model-len", "256"]
        refused = subprocess.run(clash, env=env, capture_output=True, text=True, timeout=180)
        err = refused.stderr[-3000:]
        assert refused.returncode == 1, err
        assert f"HTTP proxy on port {other_port} (applications: other)" in err, err
        assert f"ignore --port {ours_port}" in err, err
        # ... and the other application's Serve is left running.
        assert httpx.get(f"http://127.0.0.1:{other_port}/other", timeout=10).text == "other"
        # Once nothing runs on that Serve, it is restarted on our port.
        gone = [str(BIN / "python"), "-c", DELETE_OTHER_APP, address]
        deleted = subprocess.run(gone, env=env, capture_output=True, text=True, timeout=180)
        assert deleted.returncode == 0, deleted.stderr[-2000:]
        serve = ServerProcess(clash, env, tmp_path / "serve2.log")
        wait_healthy(f"http://127.0.0.1:{ours_port}", serve, HEALTHY_TIMEOUT_S)
        serve.stop(grace_s=30)
        serve = None
    finally:
        if serve is not None:
            serve.stop(grace_s=30)
        for node in reversed(nodes):
            stop_node(node)
        shutil.rmtree(ray_tmp, ignore_errors=True)
