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


def test_breakdown_reads_the_stages_of_the_single_requests_from_the_server(tmp_path):
    """Against the product's gateway on a real in-process engine (tiny model): the single requests' stages come
    back from the server's monitor, one count per request, and the report's table lists them in order."""
    import asyncio

    import gateway_helpers as helpers

    import gateway.app as gateway_app
    import gateway.local_backend as local_backend
    from bench.latency import _measure, _table

    args = parse(["--model", "tiny", "--prompt-len", "24", "--output-len", "3", "--single-runs", "3"])
    args.concurrency = 2
    backend = local_backend.LocalEngineBackend(helpers.tiny_config())
    try:
        with helpers.serve_app(gateway_app.create_app(backend)) as url:
            got = asyncio.run(_measure(url, args, breakdown=True))
    finally:
        backend.close()
    stages = got["single_stages"]
    # One engine in-process: no controller and no hand-off to decode.
    assert list(stages) == ["admission", "prefill_queue", "prefill_forward", "first_token_out", "overhead"]
    assert all(s["count"] == 3 for s in stages.values()), stages
    assert stages["prefill_forward"]["p50_ms"] > 0
    report = {"single_runs": 3, "results": [{"system": "colocated", "time_to_healthy_s": 0.0, **got}]}
    rows = _table(report)
    assert [r[1] for r in rows if r[1].startswith("stage ")] == [f"stage {n}" for n in stages]
