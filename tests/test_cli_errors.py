"""A new user's mistakes, through the real ``bucketserve`` command: each fails before Ray starts, in one line
on stderr that names the flag (or the file and key), with exit code 2."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.server_process import free_port


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The single line of stderr; fails with everything printed otherwise."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "Ray" not in result.stderr
    assert result.stdout == ""
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--port", "-1"],
            "bucketserve serve: error: argument --port: invalid port: -1 (must be from 1 to 65535)",
        ),
        (["--port", "70000"], "argument --port: invalid port: 70000"),
        (["--port", "abc"], "argument --port: invalid port: 'abc'"),
        (["--model", "/no/such/dir"], "error: --model /no/such/dir: no such folder"),
        (
            ["--max-model-len", "100000"],
            "error: --max-model-len (100000) exceeds the model's max_position_embeddings (4096)",
        ),
        (["--max-model-len", "0"], "error: --max-model-len must be a positive integer, got 0"),
        (["--max-num-seqs", "0"], "error: --max-num-seqs must be a positive integer, got 0"),
        (["--gpu-memory-utilization", "1.5"], "error: --gpu-memory-utilization must be in (0, 1], got 1.5"),
        (["--prefill-workers", "0"], "error: --prefill-workers must be an int >= 1, got 0"),
        (["--bogus-flag"], "bucketserve serve: error: unrecognized arguments: --bogus-flag"),
        (
            ["--prefil-workers", "2"],
            "unrecognized arguments: --prefil-workers (did you mean --prefill-workers?)",
        ),
        (["--log-level", "LOUD"], "argument --log-level: invalid choice: 'LOUD'"),
        (["--config", "/no/such.yaml"], "error: --config /no/such.yaml: no such file"),
        (
            ["tiny", "--model", "small"],
            "error: the model is given twice ('tiny' and --model 'small'): give one",
        ),
        (
            ["--kv-host", "0.0.0.0"],
            "error: --kv-host 0.0.0.0 is not a loopback address: serving KV there needs TLS (--kv-tls-cert and "
            "--kv-tls-key)",
        ),
        (["--kv-host", "10.1.2.3"], "error: --kv-host 10.1.2.3 is not a loopback address"),
        (["--kv-tls-cert", "/no/such.pem"], "error: --kv-tls-cert and --kv-tls-key must be set together"),
        (
            ["--kv-tls-cert", "/no/such.pem", "--kv-tls-key", "/no/such.key"],
            "error: --kv-tls-cert: no such file '/no/such.pem'",
        ),
        (["--kv-tls-ca", "/no/ca.pem"], "error: --kv-tls-ca: no such file '/no/ca.pem'"),
        (["--kv-auth-token", "two words"], "error: --kv-auth-token must be printable ASCII without spaces"),
        (["--kv-auth-token", ""], "error: --kv-auth-token must be a non-empty string when set"),
        (["--direct-ingress", "yes"], "argument --direct-ingress: invalid choice: 'yes'"),
        (["--kv-stream-layers", "yes"], "argument --kv-stream-layers: invalid choice: 'yes'"),
        (
            ["--kv-stream-layers", "on", "--no-kv-stream-layers"],
            "error: --no-kv-stream-layers contradicts --kv-stream-layers on: give one",
        ),
        (
            ["--direct-ingress", "on", "--gateway-replicas", "2"],
            "error: --direct-ingress on serves one gateway replica on --port, got --gateway-replicas 2",
        ),
        (
            ["--direct-ingress", "on", "--address", "auto"],
            "error: --direct-ingress on cannot join a running cluster (--address auto)",
        ),
    ],
)
def test_bad_serve_flags_fail_in_one_line(args, expected):
    assert expected in one_line_error(cli("serve", *args))


def test_a_port_in_use_is_found_before_anything_starts():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        line = one_line_error(cli("serve", "--port", str(port)))
    assert line == f"error: --port {port}: 127.0.0.1:{port} is already in use"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "port: 9000\nmode colocated\nfoo: : bar\n",
            "typo.yaml line 3, column 1: could not find expected ':'",
        ),
        ('port: "abc"\n', "typo.yaml: port: invalid port: 'abc'"),
        ("mode: foo\n", "typo.yaml: mode: invalid choice: 'foo' (choose from 'disaggregated', 'colocated')"),
        ("prefil_workers: 2\n", "typo.yaml: unknown key 'prefil_workers'; did you mean 'prefill_workers'?"),
        ("max-model-len: 100000\n", "--max-model-len (100000) exceeds the model's max_position_embeddings"),
        ("- port\n", "typo.yaml: expected a mapping of flag names to values, got list"),
        ("kv_host: 0.0.0.0\n", "error: --kv-host 0.0.0.0 is not a loopback address"),
    ],
)
def test_bad_config_files_fail_in_one_line(tmp_path, text, expected):
    (tmp_path / "typo.yaml").write_text(text)
    line = one_line_error(cli("serve", "--config", "typo.yaml", cwd=tmp_path))
    assert line.startswith("error: ") and expected in line, line


def test_a_bad_kv_token_in_the_environment_is_named_as_the_variable():
    env = {**os.environ, "BUCKETSERVE_KV_TOKEN": "has space"}
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve"], capture_output=True, text=True, timeout=120, env=env
    )
    assert one_line_error(result) == "error: $BUCKETSERVE_KV_TOKEN must be printable ASCII without spaces"


def test_kv_tls_files_that_do_not_load_fail_before_anything_starts(tmp_path):
    cert, key = tmp_path / "kv.pem", tmp_path / "kv.key"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    line = one_line_error(
        cli("serve", "--kv-host", "0.0.0.0", "--kv-tls-cert", str(cert), "--kv-tls-key", str(key))
    )
    assert line.startswith(f"error: --kv-tls-cert {cert} with --kv-tls-key {key}: cannot load them"), line


def test_log_level_after_the_subcommand_and_debug_errors_stay_one_line(tmp_path):
    # Accepted after the subcommand (it used to be refused there); a flag error stays one line under DEBUG.
    line = one_line_error(cli("serve", "--log-level", "debug", "--port", "0"))
    assert "argument --port: invalid port: 0" in line


def test_generate_refuses_an_empty_prompt():
    assert one_line_error(cli("generate", "--model", "tiny", "--prompt", "")) == (
        "error: the prompt is empty after tokenization"
    )


def test_generate_refuses_what_does_not_fit_the_context():
    line = one_line_error(
        cli("generate", "--model", "tiny", "--max-model-len", "4", "--max-tokens", "8", "--prompt", "hi")
    )
    assert "--max-tokens 8" in line and "--max-model-len 4" in line


def test_version_and_help_show_defaults_and_examples():
    from importlib import metadata

    result = cli("--version")
    assert (
        result.returncode == 0 and result.stdout.strip() == f"bucketserve {metadata.version('bucketserve')}"
    )
    text = cli("serve", "--help").stdout
    for needle in (
        "(default: 8000)",
        "(default: disaggregated)",
        "(default: auto)",
        "--enable-prefix-caching, --prefix-caching",
        "--disable-log-requests",
        "--uvicorn-log-level",
        "examples:",
        "MODEL",
    ):
        assert needle in text, needle
    # Every option says what it does.
    from gateway.commands.serve import _serve_parser

    undocumented = [a.option_strings for a in _serve_parser()._actions if a.option_strings and not a.help]
    assert undocumented == []
    for command in ("generate", "buckets", "serve"):
        assert "examples:" in cli(command, "--help").stdout, command
