"""The documented Ray path: ``serve run deploy/serve_config.yaml`` against a ``ray start --head --num-cpus 2``.

The head and ``serve run`` are the real command-line tools, each in its own process session (so stopping them
stops only what this test started); the YAML is the repository's file with only its HTTP port changed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from cluster_helpers import cluster_config
from prometheus_client.parser import text_string_to_metric_families
from ray_nodes import BIN, cluster_env, start_node, stop_node, tail

from bench.server_process import REPO_ROOT, ServerProcess, free_port, wait_healthy

pytestmark = pytest.mark.slow

HEALTHY_TIMEOUT_S = 240.0


def _serve_logs(ray_tmp: Path) -> str:
    """The Serve controller's log: where a failed application build is told."""
    logs = sorted((ray_tmp / "session_latest" / "logs" / "serve").glob("controller_*.log"))
    return "\n".join(f"--- {p.name}\n{tail(p)}" for p in logs)


@pytest.fixture
def ray_head(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """A 2-CPU Ray head on free ports in its own temp dir, as `ray start --head` starts it; yields the
    environment that reaches it (its address, its token) and its temp dir."""
    # Short: Ray's socket paths under its temp dir must fit in 107 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="bsray-", dir="/tmp"))
    env = cluster_env()
    port = free_port()
    head = start_node(env, ray_tmp, tmp_path / "ray_head.log", head_port=port)
    try:
        yield {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, ray_tmp
    finally:
        stop_node(head)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _metrics(base: str) -> dict[str, list]:
    text = httpx.get(base + "/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_serve_run_deploy_config_on_a_two_cpu_head(ray_head, tmp_path: Path):
    env, ray_tmp = ray_head
    doc = yaml.safe_load((REPO_ROOT / "deploy" / "serve_config.yaml").read_text())
    http_port = free_port()
    doc["http_options"]["port"] = http_port
    config = tmp_path / "serve_config.yaml"
    config.write_text(yaml.safe_dump(doc))

    t0 = time.monotonic()
    serve = ServerProcess([str(BIN / "serve"), "run", str(config)], env, tmp_path / "serve_run.log")
    base = f"http://127.0.0.1:{http_port}"
    try:
        try:
            wait_healthy(base, serve, HEALTHY_TIMEOUT_S)
        except RuntimeError as e:
            pytest.fail(f"serve run: {e}\n{_serve_logs(ray_tmp)}")
        print(f"serve run healthy after {time.monotonic() - t0:.1f}s")

        r = httpx.post(
            base + "/v1/completions",
            json={"model": "default", "prompt": "Hello there", "max_tokens": 6, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["finish_reason"] == "length"

        # Workers report to the monitor (found in the cluster's namespace, not serve run's) on a heartbeat.
        deadline = time.monotonic() + 30
        while True:
            families = _metrics(base)
            up = {
                (s.labels["role"], s.labels["worker_id"]): s.value
                for s in families.get("bucketserve:worker_up", [])
            }
            kv = sum(s.value for s in families.get("bucketserve:kv_transfer_bytes", []))
            want = {("prefill", "bucketserve:prefill-0"): 1.0, ("decode", "bucketserve:decode-0"): 1.0}
            if up == want and kv > 0:
                break
            assert time.monotonic() < deadline, f"worker_up {up}, kv_transfer_bytes {kv}"
            time.sleep(0.5)
    finally:
        # Ctrl-C: serve run deletes the application; the workers go with the head.
        serve.stop(grace_s=20)


def test_a_cluster_too_small_for_its_workers_fails_at_once(ray_session):
    from gateway.cluster_launch import ClusterTooSmall, launch_cluster

    have = ray_session.cluster_resources()["CPU"]
    # Two workers of all the cluster's CPUs each.
    config = dataclasses.replace(cluster_config("disaggregated", "toosmall"), worker_num_cpus=have)
    with pytest.raises(ClusterTooSmall, match="worker_num_cpus"):
        launch_cluster(config)
    with pytest.raises(ValueError, match="toosmall:monitor"):  # nothing was started
        ray_session.get_actor(config.actor_name("monitor"), namespace=config.namespace)


def test_a_redeploy_replaces_the_cluster_the_last_build_left_running(ray_session):
    """``serve run`` again, or ``serve deploy`` of a changed config: the second build stops the detached actors of
    the first and launches anew (their names were taken); a gateway still holding the old ones reports them
    stale, so Serve's health check replaces it, and a new one connects to the running cluster."""
    import ray

    from gateway.cluster_backend import RayClusterBackend
    from gateway.cluster_launch import stop_running
    from gateway.commands.serve import _serve_parser, build_serve_app, checked_cluster_config, config_values

    cli_args = {
        "model": "tiny",
        "name": "redeploy",
        "skip_warmup": True,
        "num_blocks": 64,
        "max_model_len": 256,
        "worker_num_cpus": 0.5,
    }
    parser = _serve_parser()
    parser.set_defaults(**config_values(cli_args, "test"))
    config, _ = checked_cluster_config(parser.parse_args([]), detached=True)
    names = [config.actor_name("monitor"), config.actor_name("controller")] + [
        n for _, n in config.worker_ids()
    ]
    try:
        build_serve_app(cli_args)
        first = {n: ray.get_actor(n, namespace=config.namespace) for n in names}
        old_gateway = RayClusterBackend(config, launch=False)
        assert asyncio.run(old_gateway.stale_actors()) == []
        build_serve_app(dict(cli_args, max_model_len=128))  # no "name already taken"
        second = {n: ray.get_actor(n, namespace=config.namespace) for n in names}
        assert all(second[n] != first[n] for n in names)
        assert sorted(asyncio.run(old_gateway.stale_actors())) == sorted(names)
        new_gateway = RayClusterBackend(config, launch=False)
        assert asyncio.run(new_gateway.stale_actors()) == []
        assert new_gateway.model_info().max_model_len == 128  # the new config's cluster
        assert asyncio.run(new_gateway.health())["ready"] is True
    finally:
        stopped = stop_running(config)
    assert sorted(stopped) == sorted(names)
    for n in names:
        with pytest.raises(ValueError):
            ray.get_actor(n, namespace=config.namespace)
