"""``bucketserve buckets``: the DESIGN.md example through the CLI, in-process and as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gateway.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = [
    "buckets",
    "--strategy",
    "exponential",
    "--block-size",
    "128",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "4",
    "--max-num-prefill-seqs",
    "1",
    "--num-blocks",
    "5775",
    "--prefix-caching",
    "--json",
]
DESIGN_DECODE_BLOCKS = [128, 256, 384, 512, 640, 768, 896, 1024, 1408, 1792, 2432, 3328, 4352, 5888]


def _check_example_output(out: str) -> None:
    lines = out.strip().splitlines()
    data = json.loads(lines[-1])
    assert len(data["prompt"]) == 36 and len(data["decode"]) == 42
    assert data["prompt"][0] == [1, 128, 0] and data["prompt"][-1] == [1, 1024, 0]
    assert data["decode"] == [[bs, 1, n] for bs in (1, 2, 4) for n in DESIGN_DECODE_BLOCKS]
    assert "[Prompt][1/36] batch_size:1 query_len:128 num_blocks:0" in lines
    assert "[Decode][42/42] batch_size:4 query_len:1 num_blocks:5888" in lines
    assert sum(line.startswith("[Prompt][") for line in lines) == 36
    assert sum(line.startswith("[Decode][") for line in lines) == 42


def test_cli_in_process(capsys):
    assert main(EXAMPLE) == 0
    _check_example_output(capsys.readouterr().out)


def test_cli_subprocess():
    exe = Path(sys.executable).parent / "bucketserve"
    proc = subprocess.run(
        [str(exe), *EXAMPLE], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    _check_example_output(proc.stdout)


def test_cli_default_num_blocks_and_no_json(capsys):
    assert main(["buckets", "--block-size", "16", "--max-model-len", "256", "--max-num-seqs", "8"]) == 0
    out = capsys.readouterr().out
    assert "num_blocks 128" in out  # 8 sequences * 256 / 16 blocks
    assert not out.strip().splitlines()[-1].startswith("{")


def test_cli_bad_override_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setenv("BUCKETSERVE_DECODE_BS_BUCKET_STEP", "0")
    assert main(EXAMPLE) == 2
    assert "decode_bs.step" in capsys.readouterr().err
