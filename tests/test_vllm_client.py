"""``bench sweep --client vllm``: the ``vllm bench serve`` command line, the conversion of its result JSON into a
sweep point, and the sweep's refusals (no vLLM environment, another workload). No vLLM run here: the
environment is not installed by the test set-up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.vllm_client import VllmBench, sweep_point
from bench.workload_requests import draw_seed


def _result(duration: float, completed: int, failed: int, good: int) -> dict:
    # The fields of vLLM's saved result that the conversion reads, as `vllm bench serve --save-result` writes them.
    return {
        "duration": duration,
        "completed": completed,
        "failed": failed,
        "request_goodput": good / duration,
        "median_ttft_ms": 80.25,
        "p99_ttft_ms": 301.5,
        "median_tpot_ms": 11.0,
        "p99_tpot_ms": 40.0,
        "output_throughput": 512.0,
    }


def test_attainment_counts_good_requests_over_all_sent_including_failed() -> None:
    p = sweep_point(_result(duration=20.0, completed=38, failed=2, good=31), rate=2.0, num_prompts=40)
    assert p["slo_attainment"] == pytest.approx(31 / 40)
    assert p["failed"] == 2 and p["completed"] == 38 and p["request_rate"] == 2.0
    assert p["goodput_rps"] == pytest.approx(31 / 20)
    assert (p["ttft_p50_ms"], p["tpot_p99_ms"]) == (80.25, 40.0)
    assert p["client"] == "vllm bench serve"


def test_a_result_without_goodput_or_with_an_impossible_count_is_refused() -> None:
    r = _result(20.0, 40, 0, 40)
    with pytest.raises(ValueError, match="without --goodput"):
        sweep_point({**r, "request_goodput": None}, 2.0, 40)
    with pytest.raises(ValueError, match="41 good requests of 40"):
        sweep_point({**r, "request_goodput": 41 / 20.0}, 2.0, 40)


def test_command_runs_the_random_dataset_with_the_sweeps_slos(tmp_path: Path) -> None:
    bench = VllmBench(
        "/opt/v/bin/python", "http://127.0.0.1:9", "small", "/models/small", 40, 3, 1.0, 450, 50
    )
    cmd = bench.command(1.5, tmp_path / "r.json")
    assert cmd[:3] == ["/opt/v/bin/vllm", "bench", "serve"]
    args = dict(zip(cmd[3:], cmd[4:], strict=False))  # each flag -> the word after it
    assert args["--dataset-name"] == "random" and args["--random-input-len"] == "256"
    assert args["--random-range-ratio"] == "0.9" and args["--random-output-len"] == "64"
    assert args["--request-rate"] == "1.5" and args["--num-prompts"] == "40"
    # Each rate draws prompts of its own (vLLM would serve a repeated set from its prefix cache).
    assert (
        args["--seed"]
        == str(draw_seed(3, 1.5))
        != bench.command(2.0, tmp_path / "r.json")[cmd.index("--seed") + 1]
    )
    assert cmd[cmd.index("--goodput") + 1 : cmd.index("--goodput") + 3] == ["ttft:450", "tpot:50"]
    assert "--ignore-eos" in cmd and args["--result-filename"] == "r.json"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--vllm-python", "/nonexistent/bin/python", "--workload", "random"], "needs vLLM's environment"),
        (["--vllm-python", sys.executable, "--workload", "mixed"], "give --workload random"),
    ],
)
def test_sweep_refuses_the_vllm_client_without_its_environment_or_workload(extra, message, tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "sweep", "--rates", "1", "--client", "vllm",
         "--out", str(tmp_path), *extra],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert not (tmp_path / "report.json").exists()
    assert "Traceback" not in out.stderr  # a plain message naming the problem
