"""The deployment files in ``deploy/``: each KubeRay manifest has what a production cluster needs (Ray token
authentication, GCS fault tolerance, probes on /health, the API key from a Secret, /dev/shm in memory, the
dashboard off 0.0.0.0, in-tree autoscaling, prefill and decode worker groups on accelerators), the Ray cluster
launcher config turns token authentication on, and every embedded serve config goes through our own config
loader into a valid cluster config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import yaml
from test_kv_grpc import _self_signed

from gateway.commands.serve import _serve_parser, checked_cluster_config, config_values

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
# manifest -> (accelerator resource of Kubernetes, Ray's resource for it, the device the engine runs on)
KUBERAY = {
    "kuberay_rayservice.yaml": ("habana.ai/gaudi", "HPU", "hpu"),
    "kuberay_rayservice_cuda.yaml": ("nvidia.com/gpu", "GPU", "cuda"),
}


def _cluster_config(args: dict, tmp_path: Path, source: str):
    """``args`` as ``serve run`` hands them to ``build_serve_app``, through the same loader and checks; the files
    the config names (the KV certificate and key) are stood in for by a pair of our own."""
    args = dict(args)
    if "kv_tls_cert" in args:
        args["kv_tls_cert"], args["kv_tls_key"] = _self_signed(tmp_path, san="DNS:bucketserve-kv")
    parser = _serve_parser()
    parser.set_defaults(**config_values(args, source))
    config, _ = checked_cluster_config(parser.parse_args([]), detached=True)
    return config


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def _check_pod(template: dict, where: str) -> None:
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    for c in _containers(template):
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        assert "/dev/shm" in mounts, f"{where}: no /dev/shm volume"
        assert volumes[mounts["/dev/shm"]].get("emptyDir", {}).get("medium") == "Memory", where
        env = {e["name"]: e for e in c.get("env", [])}
        key = env.get("BUCKETSERVE_API_KEY", {}).get("valueFrom", {}).get("secretKeyRef")
        assert key and key["name"] and key["key"], f"{where}: the API key does not come from a Secret"


@pytest.mark.parametrize("name", sorted(KUBERAY))
def test_kuberay_manifest(name: str, tmp_path: Path) -> None:
    k8s_resource, ray_resource, device = KUBERAY[name]
    (doc,) = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    assert doc["kind"] == "RayService"
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["authOptions"] == {"mode": "token"}
    assert cluster["enableInTreeAutoscaling"] is True
    gcs = cluster["gcsFaultToleranceOptions"]
    assert gcs["redisAddress"] and gcs["redisPassword"]["valueFrom"]["secretKeyRef"]["name"]

    serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    http_port = serve_config["http_options"]["port"]
    (app,) = serve_config["applications"]
    assert app["import_path"] == "gateway.commands.serve:build_serve_app"
    assert "api_key" not in app["args"], "the API key belongs in a Secret, not in the manifest"
    config = _cluster_config(app["args"], tmp_path, name)
    assert config.engine.device == device and config.mode == "disaggregated"
    assert config.scaling is not None and config.scaling.enabled

    head = cluster["headGroupSpec"]
    host = head["rayStartParams"].get("dashboard-host")
    assert host and host != "0.0.0.0", f"dashboard-host {host!r}: KubeRay's default is 0.0.0.0"
    _check_pod(head["template"], "head")
    (head_container,) = _containers(head["template"])
    for probe in ("readinessProbe", "livenessProbe"):
        get = head_container[probe]["httpGet"]
        assert (get["path"], get["port"]) == ("/health", http_port), probe

    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, group in groups.items():
        _check_pod(group["template"], role)
        assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], role
        # Room for every worker the controller may add, one per pod.
        assert group["maxReplicas"] >= config.scaling.bounds(role)[1], role
        for c in _containers(group["template"]):
            assert int(c["resources"]["limits"][k8s_resource]) >= 1, f"{role}: no {k8s_resource}"
        # The custom resource the group's pods declare is the one the role's workers ask for, with a card.
        declared = json.loads(json.loads(group["rayStartParams"]["resources"]))
        wanted = config.role_resources(role)
        assert ray_resource in wanted, f"{role}_resources {wanted} asks for no {ray_resource}"
        custom = {k for k in wanted if k != ray_resource}
        assert custom and custom <= set(declared), f"{role}: asks for {custom}, its pods declare {declared}"


def test_ray_cluster_launcher_turns_token_auth_on() -> None:
    doc = yaml.safe_load((DEPLOY / "ray_cluster.yaml").read_text())
    starts = [
        c for c in doc["head_start_ray_commands"] + doc["worker_start_ray_commands"] if "ray start" in c
    ]
    assert len(starts) == 2
    assert all(c.startswith("RAY_AUTH_MODE=token ray start") for c in starts), starts
    assert "~/.ray/auth_token" in doc["file_mounts"]
    (head,) = [c for c in starts if "--head" in c]
    assert "--dashboard-host=127.0.0.1" in head


def test_serve_config_goes_through_our_loader(tmp_path: Path) -> None:
    doc = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    (app,) = doc["applications"]
    config = _cluster_config(app["args"], tmp_path, "serve_config.yaml")
    assert config.mode == app["args"]["mode"] and config.prefill_workers == app["args"]["prefill_workers"]
