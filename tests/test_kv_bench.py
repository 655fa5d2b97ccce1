"""``bench kv`` runs end to end on a small payload and reports the agreed JSON line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import bench.kv


def test_bench_kv_json_line_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    bench.kv.register(parser.add_subparsers())
    out = tmp_path / "kv.json"
    args = parser.parse_args(
        ["kv", "--tokens", "64", "256", "--repeats", "1", "--no-prefill", "--json", "--out", str(out)]
    )
    assert args.func is bench.kv.run
    args.argv = ["bench", "kv", "--json"]
    assert args.func(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    for key in (
        "grpc_gbps",
        "socket_gbps",
        "local_gbps",
        "local_backend",
        "ratio",
        "local_ratio",
        "transfer_share_of_prefill",
    ):
        assert key in summary
    assert summary["grpc_gbps"] > 0 and summary["socket_gbps"] > 0 and summary["local_backend"] == "shm"
    report = json.loads(out.read_text())
    assert report["command"].startswith("bucketserve bench kv") and len(report["rows"]) == 2
    assert "| 256 |" in out.with_suffix(".md").read_text()
