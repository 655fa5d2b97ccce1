"""``bench offline``: the paired-rounds ratio, a run of rounds end to end, and the vLLM process's failure report."""

from __future__ import annotations

import json
import sys

import pytest

from bench.offline import VllmOffline, paired_rounds
from gateway.cli import main


def test_paired_rounds_take_the_ratio_within_each_round():
    # The host slowed down by half in round 2: both systems' times moved, their ratio did not.
    got = paired_rounds([2.0, 3.0, 2.2], [2.4, 3.6, 2.2])
    assert got["ratio_rounds"] == [1.2, 1.2, 1.0]
    assert got["ratio_median"] == 1.2
    assert got["ratio_range"] == [1.0, 1.2]
    with pytest.raises(ValueError):
        paired_rounds([1.0, 2.0], [1.0])  # a round without its pair


@pytest.mark.slow
def test_rounds_time_our_engine_each_round(tmp_path, capsys):
    out = tmp_path / "offline"
    rc = main(
        ["bench", "offline", "--model", "tiny", "--skip-warmup", "--skip-hf", "--num-prompts", "3"]
        + ["--input-len", "4:12", "--output-len", "3", "--rounds", "3", "--json", "--out", str(out)]
        + ["--vllm-python", str(tmp_path / "no-such-python")]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ours = result["ours"]
    assert result["rounds"] == 3 and len(ours["rounds_s"]) == 3
    assert ours["seconds"] == sorted(ours["rounds_s"])[1]  # the median round
    # 9 output tokens over the median's seconds (reported to the millisecond)
    assert 9 / (ours["seconds"] + 5e-4) - 0.05 <= ours["tok_per_s"] <= 9 / (ours["seconds"] - 5e-4) + 0.05
    assert "no vLLM environment" in result["vllm"]["skipped"]
    assert "ratio_vs_vllm" not in result
    assert (tmp_path / "offline.md").exists()


def test_rounds_below_one_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="--rounds must be at least 1, got 0"):
        main(
            [
                "bench",
                "offline",
                "--model",
                "tiny",
                "--skip-hf",
                "--rounds",
                "0",
                "--out",
                str(tmp_path / "o"),
            ]
        )


@pytest.mark.slow
def test_a_vllm_process_that_fails_to_start_is_reported_with_its_log(tmp_path):
    # This environment's Python has no vLLM: the runner dies importing it, and the error says so.
    with (
        pytest.raises(RuntimeError) as err,
        VllmOffline(sys.executable, tmp_path, [[1, 2, 3]], 2, 64, timeout_s=120),
    ):
        pass
    msg = str(err.value)
    assert "while loading the model" in msg and "exited with code 1" in msg
    assert "vllm" in msg  # the log's last lines: the import that failed
