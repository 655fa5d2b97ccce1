"""``bucketserve bench soak`` end to end, briefly: a real server under load, then its report (failures, KV left
in use, RSS per process of the server) and nothing of the server left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_a_short_soak_reports_failures_leaks_and_rss_of_every_process(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    cmd = [sys.executable, "-m", "gateway.cli", "bench", "soak", "--model", "tiny", "--minutes", "0.2"]
    cmd += ["--rate", "2", "--sample-s", "2", "--out", str(out), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    report = json.loads(out.with_suffix(".json").read_text())
    result = report["result"]
    assert line["failed"] == result["failed"] == 0
    assert result["completed"] == result["requests"] >= 20
    assert result["leaked_kv"] is False and set(result["kv_usage_after"].values()) == {0.0}
    assert result["processes_left_after_stop"] == 0 and result["server_alive_at_end"] is True
    processes = {r["process"] for r in result["rss"]}
    for needed in ("ray::PrefillWorker", "ray::DecodeWorker", "ray::Controller", "ray::Monitor", "raylet"):
        assert needed in processes, processes
    assert all(r["rss_first_mib"] > 0 and r["drift_pct"] is not None for r in result["rss"])
    # The change split into anonymous memory and shared memory (the KV cache), for every process.
    assert all(
        isinstance(r["anon_change_mib"], float) and isinstance(r["shmem_change_mib"], float)
        for r in result["rss"]
    )
    assert result["rss_samples"] >= 3
    assert "bench soak" in report["command"]
    assert "| ray::DecodeWorker |" in out.with_suffix(".md").read_text()
