"""The KV endpoint's flags reach the workers' TransferConfig from the command line, the config file or the
environment; without a token the launcher makes one per cluster; the gateway replicas are never given it."""

from __future__ import annotations

import pytest
import yaml
from test_cluster_serve_config import settings
from test_kv_grpc import _self_signed

from gateway.cluster_launch import ClusterConfig, with_kv_token
from gateway.commands.serve import _settings, checked_cluster_config
from gateway.kv_flags import KV_TOKEN_ENV


def test_defaults_listen_on_loopback_and_leave_the_token_to_the_launcher(monkeypatch):
    monkeypatch.delenv(KV_TOKEN_ENV, raising=False)
    config, _ = checked_cluster_config(settings(["--model", "tiny"]))
    t = config.transfer
    assert (t.host, t.auth_token, t.tls_cert_file, t.tls_key_file, t.tls_ca_file) == (
        "127.0.0.1",
        None,
        None,
        None,
        None,
    )


def test_the_token_comes_from_the_flag_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(KV_TOKEN_ENV, "from-env")
    assert checked_cluster_config(settings(["--model", "tiny"]))[0].transfer.auth_token == "from-env"
    given = settings(["--model", "tiny", "--kv-auth-token", "from-flag"])
    assert checked_cluster_config(given)[0].transfer.auth_token == "from-flag"
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"model": "tiny", "kv_auth_token": "from-file"}))
    assert checked_cluster_config(settings(["--config", str(f)]))[0].transfer.auth_token == "from-file"
    monkeypatch.setenv(KV_TOKEN_ENV, "")  # an empty variable is no token
    assert checked_cluster_config(settings(["--model", "tiny"]))[0].transfer.auth_token is None


def test_tls_and_a_wide_address_from_the_config_file(tmp_path):
    cert, key = _self_signed(tmp_path)
    f = tmp_path / "c.yaml"
    f.write_text(
        yaml.safe_dump({"model": "tiny", "kv-host": "0.0.0.0", "kv-tls-cert": cert, "kv_tls_key": key})
    )
    t = checked_cluster_config(settings(["--config", str(f)]))[0].transfer
    assert (t.host, t.tls_cert_file, t.tls_key_file, t.tls_ca_file) == ("0.0.0.0", cert, key, None)
    assert t.tls_enabled


def test_the_launcher_makes_a_token_per_cluster_and_keeps_a_given_one():
    plain = ClusterConfig()
    a, b = with_kv_token(plain), with_kv_token(plain)
    assert a.transfer.auth_token and b.transfer.auth_token
    assert a.transfer.auth_token != b.transfer.auth_token and len(a.transfer.auth_token) >= 32
    assert with_kv_token(a) is a


@pytest.mark.parametrize("argv", [[], ["--kv-auth-token", "given-token"]])
def test_gateway_replicas_are_not_given_the_kv_token(argv):
    args = settings(["--model", "tiny", *argv])
    config, _ = checked_cluster_config(args)
    replica_config = _settings(config, args).backend_factory.args[0]
    assert replica_config.transfer.auth_token is None
    assert replica_config.name == config.name
