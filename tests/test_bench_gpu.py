"""``bench gpu`` end to end on the CPU (the tiny model, a few steps): every part of the report is made, and the
engine's offline outputs equal Hugging Face's static-cache ``generate`` on the same prompts. On a GPU host the same
command measures the accelerator; here it checks the benchmark's own code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.gpu import kernel_kind

REPO = Path(__file__).resolve().parents[1]


def test_bench_gpu_runs_every_step_and_matches_hf(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    cmd = [sys.executable, "-m", "bench.gpu", "--model", "tiny", "--device", "cpu", "--dtype", "float32"]
    cmd += ["--prefill", "1x64", "--decode-batches", "1,2", "--context", "64", "--repeats", "2"]
    cmd += ["--overlap-decode", "on"]  # CUDA's default, so its bookkeeping runs here too
    cmd += [
        "--offline-batch",
        "2",
        "--offline-prompt",
        "16",
        "--offline-out",
        "4",
        "--json",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())["result"]
    assert [r["step"] for r in result["rows"]] == [
        "prefill 1x64",
        "decode batch 1 @ 64",
        "decode batch 2 @ 64",
    ]
    assert all(r["measured_ms"] > 0 and r["bound_ms"] > 0 for r in result["rows"])
    assert result["overlap_decode"] == "on"
    assert result["decode_profile"] is None  # the kernel profile is taken on CUDA only
    offline = result["offline"]
    assert offline["identical_outputs"] == 2, offline


def test_kernel_names_are_sorted_into_kinds() -> None:
    assert kernel_kind("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert kernel_kind("void gemv2T_kernel_val<int, int, __nv_bfloat16, float>") == "gemm"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_kind("_paged_decode") == "attention"
    assert kernel_kind("_merge_splits") == "attention"
    assert kernel_kind("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "other"


def test_ab_times_two_engines_in_alternating_rounds(tmp_path: Path) -> None:
    out = tmp_path / "ab"
    cmd = [sys.executable, "-m", "bench.gpu", "--model", "tiny", "--device", "cpu", "--dtype", "float32"]
    cmd += ["--prefill", "1x32", "--decode-batches", "1", "--context", "32", "--repeats", "2"]
    cmd += ["--ab", "overlap-decode", "--rounds", "2", "--json", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())["result"]
    assert result["ab"] == "overlap-decode" and result["rounds"] == 2
    assert result["overlap_decode"] == {"on": "on", "off": "off"}  # two engines, the knob each way
    assert [r["step"] for r in result["rows"]] == ["prefill 1x32", "decode batch 1 @ 32"]
    for row in result["rows"]:
        assert len(row["on_ms"]) == len(row["off_ms"]) == 2 and min(row["on_ms"] + row["off_ms"]) > 0
        for a, b, ratio in zip(row["on_ms"], row["off_ms"], row["off_over_on"], strict=True):
            assert abs(ratio - b / a) < 1e-9
    assert len(result["compiled_during_rounds"]) == 4  # each engine once a round
    bad = subprocess.run(cmd + ["--rounds", "0"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--rounds must be >= 1" in bad.stderr
