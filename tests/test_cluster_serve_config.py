"""``bucketserve serve`` configuration: every flag has a config-file key; unknown keys are errors naming the key."""

from __future__ import annotations

import argparse

import pytest
import yaml

from gateway.commands.serve import add_serve_args, apply_config_file, cluster_config_from_args, config_keys


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(argv)


def test_every_flag_has_a_config_key(tmp_path):
    p = argparse.ArgumentParser()
    add_serve_args(p)
    dests = {a.dest for a in p._actions} - {"help", "config"}
    assert config_keys({d: None for d in dests}, "x").keys() == dests


def test_config_file_fills_defaults_and_flags_win(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"mode": "colocated", "decode-workers": 3, "port": 9000, "model": "tiny"}))
    args = apply_config_file(parse(["--config", str(f), "--port", "9100"]))
    assert (args.mode, args.decode_workers, args.port, args.model) == ("colocated", 3, 9100, "tiny")
    cfg = cluster_config_from_args(args)
    assert cfg.mode == "colocated" and cfg.decode_workers == 3 and cfg.engine.model == "tiny"


def test_kv_layer_streaming_is_on_unless_turned_off(tmp_path):
    assert cluster_config_from_args(parse([])).stream_kv_layers is True
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"no-kv-stream-layers": True}))
    assert cluster_config_from_args(apply_config_file(parse(["--config", str(f)]))).stream_kv_layers is False


def test_unknown_config_key_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"prefill_wrokers": 2}))
    with pytest.raises(ValueError, match="prefill_wrokers"):
        apply_config_file(parse(["--config", str(f)]))


def test_bad_values_name_the_field():
    args = parse(["--mode", "colocated"])
    args.prefill_workers = 0
    with pytest.raises(ValueError, match="ClusterConfig.prefill_workers"):
        cluster_config_from_args(args)


@pytest.mark.parametrize("name", ["local", "torch_dist"])
def test_serve_offers_only_transports_it_can_launch(name, tmp_path):
    # local needs both ends in one process, torch_dist ranks that workers are never given.
    with pytest.raises(SystemExit):
        parse(["--kv-transport", name])
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"kv-transport": name}))
    with pytest.raises(ValueError, match="ClusterConfig.kv_transport"):
        cluster_config_from_args(apply_config_file(parse(["--config", str(f)])))
    assert cluster_config_from_args(parse(["--kv-transport", "shm"])).kv_transport == "shm"


def test_deploy_serve_config_args_are_serve_keys_with_their_defaults_valid():
    from pathlib import Path

    doc = yaml.safe_load((Path(__file__).parent.parent / "deploy" / "serve_config.yaml").read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "gateway.commands.serve:build_serve_app"
    keys = config_keys(app["args"], "deploy/serve_config.yaml")  # raises on an unknown key
    p = argparse.ArgumentParser()
    add_serve_args(p)
    p.set_defaults(**keys)
    cfg = cluster_config_from_args(p.parse_args([]), detached=True)
    assert cfg.mode == app["args"]["mode"] and cfg.engine.model == app["args"]["model"]


def test_a_colocated_worker_uses_its_share_of_the_cores_unless_told():
    import os

    cores = os.cpu_count() or 1
    assert cluster_config_from_args(parse([])).worker_threads() == 1  # disaggregated: one core each
    assert cluster_config_from_args(parse(["--mode", "colocated"])).worker_threads() == cores
    two = cluster_config_from_args(parse(["--mode", "colocated", "--colocated-workers", "2"]))
    assert two.worker_threads() == max(1, cores // 2)
    assert (
        cluster_config_from_args(parse(["--mode", "colocated", "--num-threads", "3"])).worker_threads() == 3
    )
    args = parse([])
    args.num_threads = 0
    with pytest.raises(ValueError, match="ClusterConfig.num_threads"):
        cluster_config_from_args(args)
