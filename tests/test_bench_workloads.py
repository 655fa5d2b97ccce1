"""Synthetic workload statistics, and the bucketing benchmark end to end at a small size."""

from __future__ import annotations

import json
import statistics

import pytest

from bench import bucketing
from bench.workloads import WORKLOADS, sample_arrivals, sample_lengths


@pytest.mark.parametrize("workload", WORKLOADS)
def test_reproducible_and_within_the_model(workload):
    a = sample_lengths(workload, 500, seed=7, max_model_len=2048)
    assert a == sample_lengths(workload, 500, seed=7, max_model_len=2048)
    assert a != sample_lengths(workload, 500, seed=8, max_model_len=2048)
    assert all(i >= 1 and o >= 1 and i + o <= 2048 for i, o in a)


def test_statistics_match_the_reported_workloads():
    alpaca = [i for i, _ in sample_lengths("alpaca", 20_000, seed=1)]
    assert 75 <= statistics.mean(alpaca) <= 91
    assert sum(n >= 256 for n in alpaca) / len(alpaca) < 0.05
    alpaca_out = [o for _, o in sample_lengths("alpaca", 20_000, seed=1)]
    assert 60 <= statistics.mean(alpaca_out) <= 300
    longbench = sample_lengths("longbench", 2_000, seed=1, max_model_len=8192)
    assert statistics.median(i for i, _ in longbench) > 8000  # median far above the limit: truncated
    mixed = [i for i, _ in sample_lengths("mixed", 20_000, seed=1, max_model_len=4096)]
    assert all(n < 256 or n > 1024 for n in mixed)
    long_share = sum(n > 1024 for n in mixed) / len(mixed)
    assert 0.15 < long_share < 0.25
    rnd = sample_lengths(
        "random", 5_000, seed=1, random_input_len=100, random_range_ratio=0.5, random_output_len=9
    )
    assert min(i for i, _ in rnd) >= 50 and max(i for i, _ in rnd) <= 150 and {o for _, o in rnd} == {9}


def test_arrivals_have_the_requested_rate():
    times = sample_arrivals(20_000, rate=4.0, seed=3)
    assert times == sorted(times)
    assert 3.8 < len(times) / times[-1] < 4.2
    bursty = sample_arrivals(20_000, rate=4.0, seed=3, burstiness=0.3)
    gaps = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    assert statistics.pstdev(gaps) > 1.5 * statistics.pstdev(
        [b - a for a, b in zip(times, times[1:], strict=False)]
    )


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="workload"):
        sample_lengths("sharegpt", 1, 0)
    with pytest.raises(ValueError, match="rate"):
        sample_arrivals(1, 0.0, 0)


def test_bucketing_bench_small(tmp_path, capsys):
    out = tmp_path / "report"
    argv = [
        "--out",
        str(out),
        "--requests",
        "400",
        "--scheduled",
        "300",
        "--queue-sizes",
        "50,2000",
        "--json",
    ]
    assert bucketing.main(argv) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((tmp_path / "report.json").read_text())
    assert printed["padding"] == saved["padding"]
    assert saved["command"].startswith("python -m bench.bucketing --out")
    assert saved["command"] in (tmp_path / "report.md").read_text()
    pad = saved["padding"]
    # One bucket pads everything to the model length, so it wastes the most.
    assert pad["static_one_bucket"]["waste_ratio"] > pad["pow2_buckets"]["waste_ratio"]
    assert pad["static_one_bucket"]["waste_ratio"] > pad["adaptive_all_queued"]["waste_ratio"]
    assert [c["queued"] for c in saved["cost"]] == [50, 2000]
    assert all(c["scheduled"] >= 300 and c["us_per_request"] > 0 for c in saved["cost"])
