"""Every model loads through one path: built-in names, a checkpoint folder, an HF id (offline)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from engine.model_builder import ensure_builtin
from engine.model_loader import ModelNotFoundError, resolve_model_path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--log-level", "WARNING", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_from_a_saved_checkpoint_folder(tmp_path, hf_reference) -> None:
    # A Qwen2-architecture checkpoint saved by transformers itself, loaded with --model PATH.
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(ensure_builtin("tiny"))
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(3)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    proc = _cli(
        "generate", "--model", str(tmp_path), "--prompt", "def main():", "--max-tokens", "12", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prompt_token_ids"] == tok("def main():").input_ids
    assert out["token_ids"] == hf_reference(tmp_path).greedy(out["prompt_token_ids"], 12)
    assert out["text"] == tok.decode(out["token_ids"], skip_special_tokens=True)


def test_model_path_prints_the_builtin_folder_and_builds_deterministically(tmp_path, monkeypatch) -> None:
    proc = _cli("model-path", "--model", "default")
    assert proc.returncode == 0, proc.stderr
    path = proc.stdout.strip()
    assert (resolve_model_path("tiny") == resolve_model_path("default")) and str(
        resolve_model_path("tiny")
    ) == path
    # A second build in a fresh cache gives identical files (deterministic weights and tokenizer).
    monkeypatch.setenv("BUCKETSERVE_CACHE", str(tmp_path))
    other = ensure_builtin("tiny")
    assert str(other).startswith(str(tmp_path))
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (other / name).read_bytes() == (type(other)(path) / name).read_bytes(), name
    shutil.rmtree(other)


def test_unknown_model_fails_clearly_offline() -> None:
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve_model_path("no-such-org/no-such-model")
    with pytest.raises(ModelNotFoundError, match="no such folder"):
        resolve_model_path("./definitely/not/here")
    proc = _cli("generate", "--model", "no-such-org/no-such-model", "--prompt", "x")
    assert proc.returncode != 0 and "never downloads" in proc.stderr
