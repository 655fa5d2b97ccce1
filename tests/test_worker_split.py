"""``serve --prefill-workers auto --decode-workers auto``: the split the capacity simulator recommended and kept
(``simulate --target-rate R --save-split``), read at start-up; errors name what to run or which flag is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.commands.serve import _serve_parser, checked_cluster_config, resolve_settings
from gateway.flags import FlagError
from gateway.worker_split import (
    WorkerSplit,
    load_split,
    parse_worker_count,
    resolve_counts,
    save_split,
    split_path,
)


def _split(model: str = "tiny", p: int = 3, d: int = 2) -> WorkerSplit:
    return WorkerSplit(
        model, p, d, 4.0, "mixed", 450.0, 50.0, 0.93, "calibration tiny", "2026-11-26T00:00:00+00:00"
    )


def test_counts_parse_as_integers_or_auto() -> None:
    assert parse_worker_count("3") == 3 and parse_worker_count(2) == 2
    assert parse_worker_count("auto") == "auto" and parse_worker_count(" AUTO ") == "auto"
    assert parse_worker_count("0") == 0  # out of range: the cluster config says so, naming the flag
    for bad in ("1.5", "two", ""):
        with pytest.raises(ValueError, match="an integer or 'auto'"):
            parse_worker_count(bad)


def test_a_kept_split_reads_back_and_a_missing_one_names_the_command(tmp_path: Path) -> None:
    path = save_split(_split(), tmp_path / "s.json")
    assert load_split("tiny", path) == _split()
    with pytest.raises(ValueError, match=r"bucketserve simulate --model small --target-rate .* --save-split"):
        load_split("small", tmp_path / "none.json")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid"):
        load_split("tiny", path)
    path.write_text(json.dumps({**json.loads(json.dumps(_split().__dict__)), "decode_workers": 0}))
    with pytest.raises(ValueError, match="decode_workers must be an integer >= 1"):
        load_split("tiny", path)


def test_paths_are_per_model_and_checkpoints_with_one_folder_name_do_not_share(tmp_path: Path) -> None:
    assert split_path("tiny", tmp_path) == tmp_path / "splits" / "tiny.json"
    a, b = (
        split_path(str(tmp_path / "a" / "ckpt"), tmp_path),
        split_path(str(tmp_path / "b" / "ckpt"), tmp_path),
    )
    assert a != b and a.name.startswith("ckpt-") and a.parent == tmp_path / "splits"


def test_resolution_needs_both_auto_and_reads_the_file(tmp_path: Path) -> None:
    path = save_split(_split(p=3, d=2), tmp_path / "s.json")
    assert resolve_counts(2, 1, "tiny", "disaggregated", path) == ((2, 1), None)
    assert resolve_counts("auto", "auto", "tiny", "disaggregated", path) == ((3, 2), _split(p=3, d=2))
    with pytest.raises(ValueError, match="--prefill-workers auto needs --decode-workers auto"):
        resolve_counts("auto", 2, "tiny", "disaggregated", path)
    with pytest.raises(ValueError, match="--decode-workers auto needs --prefill-workers auto"):
        resolve_counts(1, "auto", "tiny", "disaggregated", path)


def test_serve_starts_the_kept_split_and_says_what_to_run_without_one(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("BUCKETSERVE_CACHE", str(tmp_path))
    argv = ["--model", "tiny", "--prefill-workers", "auto", "--decode-workers", "auto"]
    args = resolve_settings(_serve_parser().parse_args(argv), argv)
    with pytest.raises(FlagError, match="no split has been recommended for model 'tiny'"):
        checked_cluster_config(args)
    save_split(_split(p=2, d=3))
    config, _ = checked_cluster_config(args)
    assert (config.prefill_workers, config.decode_workers) == (2, 3)
    assert [role for role, _ in config.worker_ids()] == ["prefill"] * 2 + ["decode"] * 3


def test_simulate_keeps_the_split_it_recommends(tmp_path: Path) -> None:
    # The simulator on the kept calibration of the tiny model: every split of 3 workers at one rate.
    env = {**os.environ, "BUCKETSERVE_CACHE": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "simulate", "--model", "tiny", "--rates", "8", "--num-prompts", "60",
         "--target-rate", "8", "--cards", "3", "--save-split", "--json"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    p, d = (int(x) for x in result["split"]["recommended"].split(":"))
    kept = load_split("tiny", split_path("tiny", tmp_path))
    assert (kept.prefill_workers, kept.decode_workers) == (p, d) and p + d == 3
    assert kept.target_rate == 8.0 and kept.attainment == result["split"]["recommended_attainment"]
    assert result["split"]["saved_to"] == str(split_path("tiny", tmp_path))
    refused = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "simulate", "--model", "tiny", "--rates", "8", "--save-split"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert refused.returncode == 2 and "--save-split needs --target-rate" in refused.stderr
