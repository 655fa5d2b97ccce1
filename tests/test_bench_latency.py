"""``bench latency``'s systems: our serving modes and vLLM's server, each started from its own command line."""

from __future__ import annotations

import argparse

import pytest

from bench.latency import _command, register


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p.parse_args(["latency", *argv])


def test_our_modes_run_our_server_with_the_shared_length_cap():
    args = parse(["--systems", "colocated", "--model", "small", "--max-model-len", "1024"])
    cmd, env = _command("colocated", args, 8123)
    assert cmd[1:4] == ["-m", "gateway.cli", "serve"] and env == {}
    assert cmd[cmd.index("--mode") + 1] == "colocated" and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--max-model-len") + 1] == "1024"
    assert parse(["--modes", "disaggregated"]).systems == "disaggregated"  # the older flag name still works


def test_vllm_runs_vllm_serve_of_the_same_checkpoint(tmp_path):
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text("")
    args = parse(["--systems", "vllm", "--model", "tiny", "--vllm-python", str(python)])
    cmd, env = _command("vllm", args, 9000)
    assert cmd[0] == str(tmp_path / "bin" / "vllm") and cmd[1] == "serve"
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny" and "VLLM_CPU_KVCACHE_SPACE" in env
    with pytest.raises(SystemExit, match="no vLLM environment"):
        _command("vllm", parse(["--vllm-python", str(tmp_path / "none")]), 9000)
