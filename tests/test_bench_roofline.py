"""``bench roofline``: its bound arithmetic against hand counts, and one small run end to end."""

from __future__ import annotations

import json

import pytest
import torch

from bench.roofline import ModelShape
from gateway.cli import main


def test_bounds_count_what_a_step_moves_and_computes():
    s = ModelShape(layers=2, heads=4, kv_heads=2, head_dim=8, hidden=32, vocab=100, layer_params=1000, elem=4)
    assert s.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4  # K and V, per layer and KV head
    # Decode: every weight and the LM head once, each sequence's context read and its new token written.
    assert s.decode_bytes(batch=3, context=10) == (1000 + 32 * 100) * 4 + 3 * 12 * s.kv_bytes_per_token
    # A query at position p attends to p + 1 keys: 2 FLOPs per multiply-add, for QK^T and for PV.
    assert s.attention_flops([0, 4]) == 4 * 2 * 4 * 8 * (1 + 5)
    assert s.decode_flops(batch=2, context=9) == 2 * 2 * (1000 + 3200) + 2 * 4 * 2 * 4 * 8 * 10
    # Prefill of t tokens: dense work per token, the LM head once per sequence, causal attention.
    t = 5
    assert s.prefill_flops(batch=2, tokens=t) == 2 * 1000 * 2 * t + 2 * 32 * 100 * 2 + 2 * 4 * 2 * 4 * 8 * 15


def test_the_phases_bound_adds_the_gemm_phase_and_the_attention_phase():
    s = ModelShape(layers=2, heads=4, kv_heads=2, head_dim=8, hidden=32, vocab=100, layer_params=1000, elem=4)
    weights, kv = (1000 + 3200) * 4, 3 * 12 * s.kv_bytes_per_token
    dense, attention = 2 * 4200 * 3, 3 * s.attention_flops([10])
    # Memory-bound everywhere: the phases' bounds add up to the whole step's memory bound.
    assert s.phases_bound_s(3, 10, bandwidth=1.0, rate=1e12) == pytest.approx(weights + kv)
    # GEMMs compute-bound (20000 s against 16800 s of weights), attention memory-bound: their sum exceeds
    # either whole-step bound.
    bw, rate = 1.0, dense / 20000
    assert attention / rate < kv
    assert s.phases_bound_s(3, 10, bw, rate) == pytest.approx(20000 + kv)
    assert s.phases_bound_s(3, 10, bw, rate) > max(s.decode_bytes(3, 10) / bw, s.decode_flops(3, 10) / rate)


def test_parameter_count_is_the_models(tmp_path):
    from engine.model_loader import load_model

    model = load_model("tiny", torch.device("cpu"), "float32").model
    shape = ModelShape.of(model, 4)
    embed = model.model.embed_tokens.weight.numel()
    head = model.lm_head.weight.numel()
    assert shape.layer_params == sum(p.numel() for p in model.parameters()) - embed - (
        head if model.lm_head.weight is not model.model.embed_tokens.weight else 0
    )


@pytest.mark.slow
@pytest.mark.parametrize("remeasure", [True, False])
def test_small_run_reports_every_step_with_its_bound(tmp_path, capsys, remeasure: bool):
    out = tmp_path / "roofline"
    rc = main(
        ["bench", "roofline", "--model", "tiny", "--skip-warmup", "--prefill", "1x64,2x32"]
        + ["--decode-batches", "1,4", "--context", "48", "--repeats", "2", "--json", "--out", str(out)]
        + ([] if remeasure else ["--no-remeasure"])
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bandwidth_GBps"] > 0 and result["gemm_GFLOPs"] > 0
    steps = [r["step"] for r in result["rows"]]
    assert steps == ["prefill 1x64", "prefill 2x32", "decode batch 1 @ 48", "decode batch 4 @ 48"]
    for r in result["rows"]:
        assert r["measured_ms"] > 0 and r["bound_ms"] > 0
        assert r["ratio"] == pytest.approx(r["measured_ms"] / r["bound_ms"])
        if remeasure:  # each step's bound from the machine measured just before and just after its steps
            assert len(r["machine_GBps"]) == len(r["machine_GFLOPs"]) == 2
            assert min(r["machine_GBps"] + r["machine_GFLOPs"]) > 0
            rate = sum(r["machine_GFLOPs"]) / 2 * 1e9
        else:  # every bound from the figures measured at the start
            assert "machine_GBps" not in r
            rate = result["gemm_GFLOPs"] * 1e9
        if r["step"].startswith("prefill"):
            assert r["bound_ms"] == pytest.approx(r["flops"] / rate * 1e3)
        if r["step"].startswith("decode"):  # never below the whole step's bound
            assert r["phases_bound_ms"] >= r["bound_ms"] * (1 - 1e-9)
            assert r["ratio_phases"] == pytest.approx(r["measured_ms"] / r["phases_bound_ms"])
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["result"] == result and "Roofline" in saved["title"]


@pytest.mark.slow
def test_prefill_only_run_sizes_the_cache_for_its_prefills(tmp_path, capsys):
    # No decode rows, and prefills far larger than a decode at this context would need: the cache is sized
    # for the largest prefill, not for the decodes alone.
    rc = main(
        [
            "bench",
            "roofline",
            "--model",
            "tiny",
            "--skip-warmup",
            "--prefill",
            "8x128",
            "--decode-batches",
            "",
        ]
        + ["--context", "16", "--repeats", "2", "--json", "--out", str(tmp_path / "roofline")]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["step"] for r in result["rows"]] == ["prefill 8x128"]
    assert result["rows"][0]["measured_ms"] > 0
