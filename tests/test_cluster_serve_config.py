"""``bucketserve serve`` configuration: the config file is read through the flags' own parser (types, choices,
aliases), flags given on the command line win, and every error is one line naming the flag or the key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from gateway.commands.serve import (
    _NOT_CONFIG,
    _serve_parser,
    checked_cluster_config,
    cluster_config_from_args,
    config_values,
    resolve_settings,
)
from gateway.flags import FlagError


def parse(argv: list[str]) -> argparse.Namespace:
    return _serve_parser().parse_args(argv)


def settings(argv: list[str]) -> argparse.Namespace:
    """As ``bucketserve serve ARGV`` resolves them: defaults < --config file < flags given."""
    return resolve_settings(parse(argv), argv)


def config_file(tmp_path: Path, data: dict | str) -> str:
    f = tmp_path / "c.yaml"
    f.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(f)


def test_every_flag_has_a_config_key():
    p = _serve_parser()
    dests = {a.dest for a in p._actions if a.option_strings} - {"help"} - _NOT_CONFIG
    defaults = vars(p.parse_args([]))
    # Each key parses, with its default value, through the flag's own type.
    values = config_values({d: defaults[d] for d in dests if defaults[d] is not None}, "x")
    assert set(values) <= dests
    assert {d for d in dests if defaults[d] is not None} == set(values)


def test_config_file_fills_defaults_and_flags_win(tmp_path):
    f = config_file(tmp_path, {"mode": "colocated", "decode-workers": 3, "port": 9000, "model": "tiny"})
    args = settings(["--config", f, "--port", "9100"])
    assert (args.mode, args.decode_workers, args.port, args.model) == ("colocated", 3, 9100, "tiny")
    cfg = cluster_config_from_args(args)
    assert cfg.mode == "colocated" and cfg.decode_workers == 3 and cfg.engine.model == "tiny"


def test_a_flag_given_explicitly_wins_even_when_it_equals_its_default(tmp_path):
    f = config_file(tmp_path, {"port": 18600, "prefill_workers": 2})
    args = settings(["--port", "8000", "--prefill-workers", "1", "--config", f])
    assert (args.port, args.prefill_workers) == (8000, 1)
    assert (settings(["--config", f]).port, settings(["--config", f]).prefill_workers) == (18600, 2)


def test_the_model_may_be_positional_as_in_vllm(tmp_path):
    assert settings(["tiny"]).model == "tiny"
    assert settings(["tiny", "--model", "tiny"]).model == "tiny"
    with pytest.raises(FlagError, match="given twice"):
        settings(["tiny", "--model", "small"])
    f = config_file(tmp_path, {"model": "small"})
    assert settings(["--config", f, "tiny"]).model == "tiny"  # the command line wins


def test_config_values_go_through_the_flags_types_and_choices(tmp_path):
    cases = {
        "port: abc": "port: invalid port: 'abc'",
        "port: 0": "port: invalid port: 0",
        "mode: foo": "mode: invalid choice: 'foo'",
        "prefill_workers: 1.5": "prefill_workers: expected an integer or 'auto', got '1.5'",
        "no_pin_cores: maybe": "no_pin_cores: expected true or false",
        "max_model_len: [1, 2]": "max_model_len: expected a single value",
    }
    for text, message in cases.items():
        f = config_file(tmp_path, text + "\n")
        with pytest.raises(FlagError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
            settings(["--config", f])
        assert str(e.value).startswith(f), str(e.value)


def test_aliases_and_switches_as_config_keys(tmp_path):
    f = config_file(tmp_path, {"enable-prefix-caching": True, "no-kv-stream-layers": True, "dtype": "auto"})
    args = settings(["--config", f])
    assert args.prefix_caching is True and args.no_kv_stream_layers is True
    assert cluster_config_from_args(args).stream_kv_layers is False
    assert cluster_config_from_args(parse([])).stream_kv_layers is None  # auto: each prefill worker decides
    on = settings(["--config", config_file(tmp_path, {"kv-stream-layers": "on"})])
    assert cluster_config_from_args(on).stream_kv_layers is True
    assert cluster_config_from_args(parse(["--kv-stream-layers", "off"])).stream_kv_layers is False
    # Late last is on unless switched off, from a flag or a config key; the online order rides beside it.
    assert cluster_config_from_args(parse([])).policy.late_last is True
    off = cluster_config_from_args(parse(["--late-last", "off", "--online-order", "deadline"])).policy
    assert off.late_last is False and off.online_order == "deadline"
    keyed = settings(["--config", config_file(tmp_path, {"late-last": "off"})])
    assert cluster_config_from_args(keyed).policy.late_last is False
    assert (
        settings(["--prefix-caching"]).prefix_caching is settings(["--enable-prefix-caching"]).prefix_caching
    )


def test_unknown_config_key_is_named_with_a_suggestion(tmp_path):
    f = config_file(tmp_path, {"prefil_workers": 2})
    with pytest.raises(FlagError, match="unknown key 'prefil_workers'; did you mean 'prefill_workers'"):
        settings(["--config", f])


def test_yaml_syntax_error_is_one_line_with_its_place(tmp_path):
    f = config_file(tmp_path, "port: 9000\nmode colocated\nfoo: : bar\n")
    with pytest.raises(FlagError, match=r"c\.yaml line \d+, column \d+: ") as e:
        settings(["--config", f])
    assert "\n" not in str(e.value)


def test_bad_values_name_the_flag_not_the_config_field():
    for argv, flag in (
        (["--mode", "colocated", "--colocated-workers", "0"], "--colocated-workers"),
        (["--prefill-workers", "0"], "--prefill-workers"),
        (["--max-model-len", "0"], "--max-model-len"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
    ):
        with pytest.raises(FlagError, match=flag) as e:
            checked_cluster_config(settings(argv))
        assert "Config." not in str(e.value), str(e.value)


def test_the_model_is_read_up_front():
    with pytest.raises(FlagError, match="--model /no/such/dir: no such folder"):
        checked_cluster_config(settings(["--model", "/no/such/dir"]))
    with pytest.raises(
        FlagError, match=r"--max-model-len \(100000\) exceeds the model's max_position_embeddings"
    ):
        checked_cluster_config(settings(["--model", "tiny", "--max-model-len", "100000"]))
    config, facts = checked_cluster_config(settings(["--model", "tiny"]))
    # --dtype auto takes the checkpoint's dtype; the length cap comes from the model.
    assert config.engine.dtype == facts.dtype == "float32"
    assert config.engine.scheduler.max_model_len == min(2048, facts.max_position_embeddings)


@pytest.mark.parametrize("name", ["local", "torch_dist"])
def test_serve_offers_only_transports_it_can_launch(name, tmp_path):
    # local needs both ends in one process, torch_dist ranks that workers are never given.
    with pytest.raises(SystemExit):
        parse(["--kv-transport", name])
    f = config_file(tmp_path, {"kv-transport": name})
    with pytest.raises(FlagError, match="kv-transport: invalid choice"):
        settings(["--config", f])
    assert cluster_config_from_args(parse(["--kv-transport", "shm"])).kv_transport == "shm"


def test_deploy_serve_config_args_are_serve_keys_with_their_defaults_valid():
    doc = yaml.safe_load((Path(__file__).parent.parent / "deploy" / "serve_config.yaml").read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "gateway.commands.serve:build_serve_app"
    p = _serve_parser()
    p.set_defaults(**config_values(app["args"], "deploy/serve_config.yaml"))  # raises on a bad key or value
    cfg, _ = checked_cluster_config(p.parse_args([]), detached=True)
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
    with pytest.raises(FlagError, match="--num-threads"):
        checked_cluster_config(args)


def test_colocated_workers_are_pinned_to_a_share_each_and_know_their_neighbours(monkeypatch):
    from gateway import cluster_launch

    monkeypatch.setattr(cluster_launch.os, "cpu_count", lambda: 4)
    two = cluster_config_from_args(parse(["--mode", "colocated", "--colocated-workers", "2"]))
    assert [cluster_launch._cores("colocated", i, two) for i in (0, 1)] == [(0, 1), (2, 3)]
    assert cluster_launch._neighbour_cores("colocated", 0, two) == (
        (2, "bucketserve:colocated-1"),
        (3, "bucketserve:colocated-1"),
    )
    one = cluster_config_from_args(parse(["--mode", "colocated"]))
    assert cluster_launch._cores("colocated", 0, one) == (0, 1, 2, 3)
    assert cluster_launch._neighbour_cores("colocated", 0, one) == (), "alone: nobody to borrow from"
    # More workers than cores: the ones beyond the cores are not pinned, and nobody borrows from them.
    five = cluster_config_from_args(parse(["--mode", "colocated", "--colocated-workers", "5"]))
    assert cluster_launch._cores("colocated", 4, five) == ()
    assert [c for c, _ in cluster_launch._neighbour_cores("colocated", 0, five)] == [1, 2, 3]
    off = cluster_config_from_args(
        parse(["--mode", "colocated", "--colocated-workers", "2", "--share-cores", "off"])
    )
    assert cluster_launch._neighbour_cores("colocated", 0, off) == ()
    assert cluster_launch._cores("colocated", 0, off) == (0, 1), (
        "still pinned: --share-cores lends, pinning is apart"
    )


def test_a_colocated_worker_on_a_cpu_takes_short_steps_unless_told():
    from engine.config import COLOCATED_CPU_STEP_TOKENS, DEFAULT_MAX_NUM_BATCHED_TOKENS
    from gateway.cluster_launch import ClusterConfig

    default = cluster_config_from_args(parse(["--mode", "colocated"]))
    assert default.colocated_cpu_step_tokens == COLOCATED_CPU_STEP_TOKENS == 512
    assert default.engine.scheduler.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS  # accelerators
    assert cluster_config_from_args(parse([])).colocated_cpu_step_tokens is None  # disaggregated
    given = cluster_config_from_args(parse(["--mode", "colocated", "--max-num-batched-tokens", "2048"]))
    assert given.colocated_cpu_step_tokens is None  # a budget given holds on every device
    assert given.engine.scheduler.max_num_batched_tokens == 2048
    with pytest.raises(
        ValueError, match="ClusterConfig.colocated_cpu_step_tokens must be an int >= 1 or None"
    ):
        ClusterConfig(mode="colocated", colocated_cpu_step_tokens=0)


def test_api_key_comes_from_the_environment_unless_given(monkeypatch):
    from gateway.commands.serve import API_KEY_ENV, api_key

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key(settings([])) is None
    monkeypatch.setenv(API_KEY_ENV, "from-secret")
    assert api_key(settings([])) == "from-secret"
    assert api_key(settings(["--api-key", "given"])) == "given"
    # An empty variable (a Secret key left blank) is no key, not an empty one.
    monkeypatch.setenv(API_KEY_ENV, "")
    assert api_key(settings([])) is None


def test_role_resources_from_flags_and_yaml(tmp_path):
    args = settings(
        ["--prefill-resources", '{"prefill": 1}', "--decode-resources", '{"GPU": 1, "decode": 0.5}']
    )
    cfg = cluster_config_from_args(args)
    assert cfg.role_resources("prefill") == {"prefill": 1.0}
    assert cfg.role_resources("decode") == {"GPU": 1.0, "decode": 0.5}
    assert cfg.role_resources("colocated") == cfg.role_resources("decode")
    # YAML takes a mapping or the same JSON text.
    f = config_file(tmp_path, "prefill_resources: {HPU: 1}\ndecode_resources: '{\"HPU\": 1}'\n")
    cfg = cluster_config_from_args(settings(["--config", f]))
    assert cfg.role_resources("prefill") == cfg.role_resources("decode") == {"HPU": 1.0}
    assert cluster_config_from_args(settings([])).role_resources("prefill") == {}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill-resources", "{prefill: 1}"], "--prefill-resources: invalid JSON"),
        (["--decode-resources", "[1]"], "--decode-resources: expected a JSON object"),
        (["--decode-resources", '{"GPU": 0}'], "'GPU': the amount must be a number > 0"),
        (["--prefill-resources", '{"x": true}'], "'x': the amount must be a number > 0"),
    ],
)
def test_bad_role_resources_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


def test_cpu_in_role_resources_points_at_worker_num_cpus():
    from gateway.cluster_launch import ClusterConfig

    with pytest.raises(
        ValueError, match="prefill_resources: give a worker's CPUs with ClusterConfig.worker_num_cpus"
    ):
        ClusterConfig(prefill_resources={"CPU": 2})
    with pytest.raises(FlagError, match="--decode-resources: give a worker's CPUs with --worker-num-cpus"):
        checked_cluster_config(settings(["--decode-resources", '{"CPU": 1}', "--model", "tiny"]))


def test_autoscaling_bounds_from_flags_and_errors_in_flag_terms():
    cfg = cluster_config_from_args(settings(["--max-prefill-workers", "3", "--scale-idle-s", "5"]))
    assert cfg.scaling is not None and cfg.scaling.bounds("prefill") == (1, 3)
    assert cfg.scaling.bounds("decode") == (1, 1) and cfg.scaling.scale_idle_s == 5
    assert cluster_config_from_args(settings([])).scaling is None  # no bounds given: no autoscaling
    with pytest.raises(
        FlagError, match=r"--prefill-workers \(1\) must lie within --min-prefill-workers \(2\)"
    ):
        checked_cluster_config(
            settings(["--min-prefill-workers", "2", "--max-prefill-workers", "3", "--model", "tiny"])
        )
    with pytest.raises(
        FlagError, match=r"--max-prefill-workers must be an int >= --min-prefill-workers \(3\)"
    ):
        checked_cluster_config(
            settings(["--prefill-workers", "3", "--max-prefill-workers", "2", "--model", "tiny"])
        )
    with pytest.raises(FlagError, match="--max-decode-workers must be an int >= --min-decode-workers"):
        checked_cluster_config(
            settings(["--min-decode-workers", "2", "--max-decode-workers", "1", "--model", "tiny"])
        )
    with pytest.raises(FlagError, match="scaling needs mode disaggregated"):
        checked_cluster_config(
            settings(["--mode", "colocated", "--max-prefill-workers", "2", "--model", "tiny"])
        )
