"""Attention layers fused for eager CPU steps (one QKV linear; rotary and cache writes in one kernel): the
kernel equals transformers' rotary embedding bit for bit and writes the right slots; the flat eager engine fuses
every layer, other engines none; the model's weights are shared, not copied; a layer that computes anything else
keeps its own forward; greedy tokens do not change (fp32 against Hugging Face in test_engine_greedy.py, bf16
here against the unfused engine)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from engine_helpers import greedy_tokens, needs_bf16_prepack, random_prompts, small_config
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

import engine.llm_engine as llm_engine
from engine.flat_attention import FLAT_ATTN_IMPLEMENTATION
from engine.fused_attention import fuse_attention_layers, is_fused
from engine.kernels import build, cpu_paged_attention
from engine.linear_prepack import prepack_linears
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model


@pytest.fixture(scope="module")
def rope():
    assert build.load_rotary() is not None, "the rotary kernel did not build"
    return torch.ops.bucketserve_cpu.rope_write_kv


def _rope_inputs(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D], as transformers' rotary module builds it
    return qkv, emb.cos().to(dtype), emb.sin().to(dtype), gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "dim"),
    [(1, 8, 4, 64), (7, 8, 4, 64), (300, 8, 4, 64), (5, 4, 2, 40), (3, 2, 2, 128)],
)
def test_kernel_equals_transformers_rotary_and_writes_the_slots(
    rope, dtype, tokens, heads, kv_heads, dim
) -> None:
    qkv, cos, sin, gen = _rope_inputs(tokens, heads, kv_heads, dim, dtype, seed=tokens + dim)
    blocks, block = 40, 16
    k_cache = torch.zeros(blocks, block, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(blocks * block, generator=gen)[:tokens]
    q = rope(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)  # [T, H, D]

    hq, hk = heads * dim, kv_heads * dim
    want_q, want_k = apply_rotary_pos_emb(
        qkv[:, :hq].view(1, tokens, heads, dim).transpose(1, 2),
        qkv[:, hq : hq + hk].view(1, tokens, kv_heads, dim).transpose(1, 2),
        cos[None],
        sin[None],
    )
    assert torch.equal(q, want_q[0].transpose(0, 1))
    assert torch.equal(k_cache.view(-1, kv_heads, dim)[slots], want_k[0].transpose(0, 1))
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], qkv[:, hq + hk :].view(tokens, kv_heads, dim))
    untouched = torch.ones(blocks * block, dtype=torch.bool)
    untouched[slots] = False
    assert (
        not k_cache.view(blocks * block, -1)[untouched].any()
        and not v_cache.view(blocks * block, -1)[untouched].any()
    )


def test_kernel_refuses_bad_slots_widths_and_dtypes(rope) -> None:
    qkv, cos, sin, _ = _rope_inputs(3, 4, 2, 16, torch.float32, seed=0)
    k_cache = torch.zeros(2, 4, 2, 16)
    v_cache = torch.zeros_like(k_cache)
    with pytest.raises(RuntimeError, match="slot 8 outside the cache's 8"):
        rope(qkv, cos, sin, k_cache, v_cache, torch.tensor([0, 8, 1]), 4, 2)
    with pytest.raises(RuntimeError, match="do not hold 8 \\+ 2 x 2 heads of 16"):
        rope(qkv, cos, sin, k_cache, v_cache, torch.tensor([0, 1, 2]), 8, 2)
    with pytest.raises(RuntimeError, match="must share one dtype"):
        rope(qkv, cos.double(), sin, k_cache, v_cache, torch.tensor([0, 1, 2]), 4, 2)


def _attention_layers(engine: LLMEngine) -> list[torch.nn.Module]:
    return [m for m in engine.loaded.model.modules() if isinstance(m, LlamaAttention)]


def test_the_flat_eager_engine_fuses_every_layer_and_shares_the_weights(rope) -> None:
    engine = LLMEngine(small_config(shape_policy="flat"))
    layers = _attention_layers(engine)
    assert layers and all(is_fused(a) for a in layers)
    fresh = load_model("tiny", torch.device("cpu"), "float32").model
    # The model's parameters are the checkpoint's, under the same names, with no second copy of Q, K and V.
    assert engine.loaded.model.state_dict().keys() == fresh.state_dict().keys()
    for a in layers:
        fused = a.qkv_linear.weight
        rows = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
        assert torch.equal(fused, torch.cat(rows))
        assert all(w.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for w in rows)
        assert all(p.packed_weight is None and p.panel_weight is None for p in (a.q_proj, a.k_proj, a.v_proj))


@pytest.mark.parametrize("engine_kw", [dict(shape_policy="buckets"), dict(shape_policy="flat", compile=True)])
def test_other_engines_keep_transformers_attention(rope, engine_kw) -> None:
    engine = LLMEngine(small_config(**engine_kw))
    assert not any(is_fused(a) for a in _attention_layers(engine))


class _DoubledAttention(LlamaAttention):
    """Computes something else than Llama's attention under the same attribute names."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return 2 * out, weights


class _PartialRotaryAttention(LlamaAttention):
    """Rotates part of each head only, so it cannot take the probe's full-width cos/sin (it raises)."""

    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        cos, _ = position_embeddings
        if cos.shape[-1] != self.head_dim // 2:
            raise ValueError(f"rotary width {cos.shape[-1]}, expected {self.head_dim // 2}")
        return super().forward(hidden_states, position_embeddings=position_embeddings, **kwargs)


@pytest.mark.parametrize("odd_class", [_DoubledAttention, _PartialRotaryAttention])
def test_a_layer_that_computes_something_else_keeps_its_own_forward(rope, odd_class) -> None:
    model = load_model("tiny", torch.device("cpu"), "float32").model
    model.set_attn_implementation(FLAT_ATTN_IMPLEMENTATION)
    prepack_linears(model)
    layers = [m for m in model.modules() if isinstance(m, LlamaAttention)]
    odd = layers[1]
    odd.__class__ = odd_class
    assert fuse_attention_layers(model, cpu_paged_attention(), torch.float32) == len(layers) - 1
    assert not is_fused(odd) and odd.q_proj.packed_weight is not None
    assert all(is_fused(a) for a in layers if a is not odd)


@needs_bf16_prepack
def test_in_bf16_the_fused_engine_generates_what_the_unfused_one_does(rope, monkeypatch) -> None:
    # Prompts of up to 64 tokens: the QKV linear then runs on the skinny kernel, whose columns sum alone, so the
    # fused projection is the three separate ones bit for bit and so are the tokens.
    prompts = random_prompts([1, 5, 17, 40, 64], seed=3)
    fused = LLMEngine(small_config(shape_policy="flat", dtype="bfloat16"))
    assert all(is_fused(a) for a in _attention_layers(fused))
    monkeypatch.setattr(llm_engine, "fuse_attention_layers", lambda *args: 0)
    plain = LLMEngine(small_config(shape_policy="flat", dtype="bfloat16"))
    assert not any(is_fused(a) for a in _attention_layers(plain))
    assert greedy_tokens(fused, prompts, 12) == greedy_tokens(plain, prompts, 12)


def test_the_paired_benchmark_reports_each_batch_with_identical_tokens(rope, tmp_path, capsys) -> None:
    from gateway.cli import main

    out = tmp_path / "fused"
    args = ["bench", "fused-attention", "--model", "tiny", "--skip-warmup", "--batches", "1,3"]
    assert main(args + ["--context", "20", "--steps", "4", "--json", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    assert all(r["identical_tokens"] and r["fused_ms"] > 0 and r["unfused_ms"] > 0 for r in result["rows"])
    assert (tmp_path / "fused.json").is_file() and (tmp_path / "fused.md").is_file()


def test_prebuild_compiles_only_what_the_cache_lacks(rope, tmp_path, monkeypatch) -> None:
    # One kernel into an empty cache: compiled once, then found built (a second start compiles nothing).
    monkeypatch.setenv("BUCKETSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "KERNELS", ((build.ROTARY_SOURCE, "rope_write_kv"),))
    library = build.build_dir(build.ROTARY_SOURCE) / "bucketserve_rotary.so"
    assert not library.exists()
    assert build.prebuild() == 1 and library.is_file()
    assert build.prebuild() == 0


def test_prebuild_stops_its_compilers_when_told(rope, tmp_path, monkeypatch) -> None:
    # A server whose start-up fails sets the event: the compile ends at once, leaving nothing built or running.
    import threading

    monkeypatch.setenv("BUCKETSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "KERNELS", ((build.ROTARY_SOURCE, "rope_write_kv"),))
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    t0 = time.perf_counter()
    assert build.prebuild(stop) == 0
    # It was compiling (a compile takes tens of seconds) and returned once told, after stopping its compiler.
    assert 0.9 < time.perf_counter() - t0 < 10
    assert not (build.build_dir(build.ROTARY_SOURCE) / "bucketserve_rotary.so").exists()
