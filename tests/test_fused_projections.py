"""Q/K/V and gate/up fused into one GEMM each (engine/fused_projections.py), on real models: the fused model
generates what the unfused one does (Hugging Face ``generate``, greedy, through the model's own cache and
attention), and through the flat runner's attention operator writes the same cache; the separate weights become
views (nothing held twice, parameters and state_dict unchanged); modules that compute something else keep their
forward. The engine takes the fusion on CUDA, whose greedy tests run it there."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import TEST_DEVICE
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from engine.fused_attention import probe_context
from engine.fused_projections import fuse_projections, fused_linear_of, is_fused_part, model_linears
from engine.model_loader import resolve_model_path


def _tiny(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    path = resolve_model_path("tiny")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(TEST_DEVICE).eval()


def _greedy(model: torch.nn.Module, ids: torch.Tensor, n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()


def _small(model_cls, config_cls, layers: int = 2, **overrides) -> torch.nn.Module:
    """A seeded random model of ``model_cls`` with a few small layers, built here (no checkpoint)."""
    sizes = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return model_cls(config_cls(**{**sizes, "num_hidden_layers": layers, **overrides})).eval()


def test_fused_model_generates_what_the_unfused_one_does() -> None:
    plain = _tiny()
    fused = copy.deepcopy(plain)
    counts = fuse_projections(fused)
    layers = plain.config.num_hidden_layers
    assert counts == {"attention": layers, "mlp": layers, "kept": 0}
    g = torch.Generator().manual_seed(3)
    for length in (1, 7, 40, 200):
        ids = torch.randint(0, plain.config.vocab_size, (1, length), generator=g).to(TEST_DEVICE)
        with torch.inference_mode():
            want, got = plain(ids).logits, fused(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert _greedy(fused, ids, 24) == _greedy(plain, ids, 24)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_llama_family_layers_are_fused_too(family: str) -> None:
    # Qwen2: biases on Q, K and V (the fused linear concatenates them) and its own sliding-window attribute;
    # Mistral: the window in its config.
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[family]
    plain = _small(model_cls, config_cls)
    with torch.no_grad():
        for m in plain.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(std=0.5)  # biases that matter
    fused = copy.deepcopy(plain)
    assert fuse_projections(fused) == {"attention": 2, "mlp": 2, "kept": 0}
    attn = fused.model.layers[0].self_attn
    assert (fused_linear_of(attn).bias is not None) == (family == "qwen2")
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    assert _greedy(fused, ids, 12) == _greedy(plain, ids, 12)


def test_bf16_fused_model_stays_within_rounding() -> None:
    plain = _tiny(torch.bfloat16)
    fused = copy.deepcopy(plain)
    assert fuse_projections(fused)["kept"] == 0
    ids = torch.randint(0, plain.config.vocab_size, (1, 33), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want, got = plain(ids.to(TEST_DEVICE)).logits.float(), fused(ids.to(TEST_DEVICE)).logits.float()
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()


def test_weights_become_views_and_the_parameters_stay_as_loaded() -> None:
    model = _tiny()
    keys = list(model.state_dict())
    count = sum(p.numel() for p in model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)
    assert list(model.state_dict()) == keys
    assert sum(p.numel() for p in model.parameters()) == count
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for module, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
        fused = fused_linear_of(module)
        assert fused is not None and fused not in list(model.modules())  # outside the module tree
        base = fused.weight.data_ptr()
        offset = 0
        for name in names:
            part = getattr(module, name)
            assert is_fused_part(part)
            assert part.weight.data_ptr() == base + offset * part.weight.element_size()  # a view, not a copy
            offset += part.weight.numel()
        assert offset == fused.weight.numel()
    # What a forward calls: the fused linears and the rest, never the parts.
    called = model_linears(model)
    assert not any(is_fused_part(m) for m in called)
    layers = model.config.num_hidden_layers
    # per layer: fused QKV, o_proj, fused gate/up, down_proj; plus the LM head
    assert len(called) == 4 * layers + 1


def test_modules_that_compute_something_else_keep_their_forward() -> None:
    # Qwen3 normalises each head of Q and K before the rotary: its attention keeps transformers' forward, its MLP
    # (the Llama formula) is fused.
    plain = _small(Qwen3ForCausalLM, Qwen3Config, head_dim=16)
    fused = copy.deepcopy(plain)
    assert fuse_projections(fused) == {"attention": 0, "mlp": 2, "kept": 0}
    assert "forward" not in fused.model.layers[0].self_attn.__dict__
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    assert _greedy(fused, ids, 12) == _greedy(plain, ids, 12)


def test_an_mlp_with_another_activation_formula_is_kept() -> None:
    # Same attribute names, another formula: the probe finds the difference and the module keeps its forward.
    class OtherMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(32, 48, bias=False)
            self.up_proj = torch.nn.Linear(32, 48, bias=False)
            self.down_proj = torch.nn.Linear(48, 32, bias=False)
            self.act_fn = torch.nn.SiLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))  # gate and up swapped

    torch.manual_seed(0)
    module = OtherMLP()
    assert fuse_projections(module) == {"attention": 0, "mlp": 0, "kept": 1}
    assert fused_linear_of(module) is None and "forward" not in module.__dict__
    assert not is_fused_part(module.gate_proj)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the probe context here is the CPU operator's")
def test_flat_attention_writes_the_same_cache_fused_or_not() -> None:
    from engine.flat_attention import FLAT_ATTN_IMPLEMENTATION
    from engine.forward_context import forward_context
    from engine.kernels import paged_attention_ref

    plain = _small(LlamaForCausalLM, LlamaConfig, layers=1)
    fused = copy.deepcopy(plain)
    fuse_projections(fused)
    results = []
    for model in (plain, fused):
        model.set_attn_implementation(FLAT_ATTN_IMPLEMENTATION)
        attn = model.model.layers[0].self_attn
        ctx = probe_context(attn, 11, paged_attention_ref)
        x = torch.randn(1, 11, 64, generator=torch.Generator().manual_seed(2))
        angles = torch.rand(1, 11, 8, generator=torch.Generator().manual_seed(4)) * 10
        rope = torch.cat((angles, angles), -1)
        with forward_context(ctx), torch.inference_mode():
            out, _ = attn(hidden_states=x, position_embeddings=(rope.cos(), rope.sin()), attention_mask=None)
        results.append((out, ctx.kv_data[0].clone()))
    (want, want_kv), (got, got_kv) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5)
    assert got_kv.abs().sum() > 0  # the layer did write its keys and values


def test_the_engine_loaded_model_is_fused_whatever_attention_it_runs() -> None:
    # The engine loads its models with its own paged attention, which reads a per-step context a probe has not
    # got: the probe runs transformers' eager attention instead, and the model's own is restored after.
    from engine.model_loader import load_model

    model = load_model("tiny", torch.device(TEST_DEVICE), "float32").model
    configured = model.config._attn_implementation
    assert configured not in ("eager", "sdpa")
    layers = model.config.num_hidden_layers
    assert fuse_projections(model) == {"attention": layers, "mlp": layers, "kept": 0}
    assert model.config._attn_implementation == configured


def test_a_kept_module_says_why(caplog) -> None:
    model = _small(LlamaForCausalLM, LlamaConfig, layers=1)
    from transformers.models.llama import modeling_llama

    class ScaledAttention(modeling_llama.LlamaAttention):
        # Something after the attention that the fused forward does not run.
        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            return out * 2, weights

    ScaledAttention.__module__ = modeling_llama.__name__  # a Llama-family layer by its module
    scaled = ScaledAttention(model.config, 0).eval()
    scaled.load_state_dict(model.model.layers[0].self_attn.state_dict())
    model.model.layers[0].self_attn = scaled
    with caplog.at_level("INFO", logger="engine.fused_projections"):
        counts = fuse_projections(model)
    assert counts == {"attention": 0, "mlp": 1, "kept": 1}
    assert "keeps its own forward: outputs differ by" in caplog.text


def test_fused_weights_are_normal_tensors_as_the_loaded_ones() -> None:
    # Built under inference mode they would be inference tensors, which a compiled forward tells apart from the
    # loaded weights it was traced with.
    model = _tiny()
    fuse_projections(model)
    attn = model.model.layers[0].self_attn
    for t in (
        fused_linear_of(attn).weight,
        attn.q_proj.weight,
        fused_linear_of(model.model.layers[0].mlp).weight,
    ):
        assert not t.is_inference() and not t.requires_grad


def test_a_module_without_memory_for_its_fused_weights_keeps_its_forward(monkeypatch, caplog) -> None:
    # Fault injection: the first concatenation finds the device full (a model that fills it); that module keeps
    # its separate linears, the rest are fused, and the model still computes what it did.
    import engine.fused_projections as fp

    plain = _tiny()
    model = copy.deepcopy(plain)
    real, calls = fp._concatenate, []

    def full_once(parts):
        calls.append(len(parts))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("device full")
        return real(parts)

    monkeypatch.setattr(fp, "_concatenate", full_once)
    with caplog.at_level("WARNING", logger="engine.fused_projections"):
        counts = fuse_projections(model)
    layers = model.config.num_hidden_layers
    assert counts["kept"] == 1 and counts["attention"] + counts["mlp"] == 2 * layers - 1
    assert "no device memory for its fused weights" in caplog.text
    ids = torch.randint(0, plain.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids.to(TEST_DEVICE)).logits, plain(ids.to(TEST_DEVICE)).logits)
