"""The Triton rotary + K/V write kernel (``engine/kernels/rope_write_triton.py``) and the attention layers that run
it (``engine/fused_rope_write.py``): it rotates queries and keys as transformers' Llama rotary does, to the dtype's
rounding, writes keys and values to their slots and nothing else; a model whose layers take it computes what the
fused-projection model computes; a family that rotates another way keeps its forward.

They run where ``triton_helpers`` says (a GPU, or Triton's interpreter on the CPU); the CI host has neither, so there
they are skipped with that reason."""

from __future__ import annotations

import copy

import pytest
import torch
from triton_helpers import TRITON_DEVICE, needs_triton

DEVICE = TRITON_DEVICE
pytestmark = needs_triton


def _heads_major(x: torch.Tensor) -> torch.Tensor:
    # [1, heads, T, D] -> [T, heads * D]
    return x[0].transpose(0, 1).reshape(x.shape[2], -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "d", "tokens"), [(4, 2, 16, 1), (4, 2, 16, 9), (3, 1, 12, 5)])
def test_kernel_rotates_as_transformers_and_writes_only_the_slots(dtype, heads, kv_heads, d, tokens) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from engine.fused_attention import probe_rope
    from engine.kernels.rope_write_triton import rope_write_kv_triton

    g = torch.Generator().manual_seed(tokens)
    q, k, v = (
        torch.randn(1, h, tokens, d, generator=g).to(DEVICE, dtype) for h in (heads, kv_heads, kv_heads)
    )
    cos, sin = probe_rope(tokens, d, g, dtype, DEVICE)  # [1, T, D]
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    qkv = torch.cat([_heads_major(x) for x in (q, k, v)], dim=1)  # [T, (H + 2 KVH) D]
    blocks, bs = 4, 4
    base = [torch.randn(blocks, bs, kv_heads, d, generator=g).to(DEVICE, dtype) for _ in range(2)]
    caches = [c.clone() for c in base]
    # Distinct slots in any order, one of them in the null block (a padding token's)
    slots = (torch.randperm(blocks * bs - 1, generator=g)[:tokens] + 1).to(DEVICE)
    slots[0] = 0
    got_q = rope_write_kv_triton(qkv, cos[0], sin[0], *caches, slots, heads, kv_heads)
    assert got_q.shape == (tokens, heads, d)
    if dtype == torch.bfloat16 and DEVICE == "cuda":
        exact = torch.equal  # each product rounded before the sum, as the eager ops round
    else:
        # fp32: a fused multiply-add may move the last bit; Triton's interpreter casts to bf16 by truncation (a
        # few units in the last place over the two products and the sum)
        tol = 1e-6 if dtype == torch.float32 else 2**-6

        def exact(a, b):
            return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)

    assert exact(got_q, want_q[0].transpose(0, 1))
    for cache, before, want in ((caches[0], base[0], want_k), (caches[1], base[1], v)):
        rows, old = cache.view(-1, kv_heads, d), before.view(-1, kv_heads, d)
        assert exact(rows[slots], want[0].transpose(0, 1))
        others = torch.ones(rows.shape[0], dtype=torch.bool)
        others[slots.cpu()] = False
        assert torch.equal(rows[others.to(DEVICE)], old[others.to(DEVICE)])


def test_kernel_names_what_it_cannot_take() -> None:
    from engine.kernels.rope_write_triton import rope_write_kv_triton

    caches = [torch.zeros(2, 4, 2, 16, device=DEVICE) for _ in range(2)]
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="do not split into 8 heads"):
        rope_write_kv_triton(torch.zeros(3, 100, device=DEVICE), *(torch.zeros(3, 16, device=DEVICE),) * 2,
                             *caches, slots, 4, 2)  # fmt: skip
    with pytest.raises(ValueError, match="cos and sin must be"):
        rope_write_kv_triton(torch.zeros(3, 128, device=DEVICE), *(torch.zeros(3, 8, device=DEVICE),) * 2,
                             *caches, slots, 4, 2)  # fmt: skip


def _model(layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_hidden_layers=layers,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(DEVICE).eval()


def _flat_logits(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt through the model on a fresh paged cache: (logits, the cache)."""
    from engine.forward_context import ForwardContext, forward_context
    from engine.kernels import paged_attention_ref

    cfg, t, bs = model.config, ids.shape[1], 4
    blocks = -(-t // bs)
    kv = torch.zeros(cfg.num_hidden_layers, 2, blocks + 1, bs, cfg.num_key_value_heads, 16, device=DEVICE)
    ctx = ForwardContext(
        kv_data=kv,
        slot_mapping=torch.arange(t, device=DEVICE) + bs,  # block 0 stays the null block
        block_table=torch.arange(1, blocks + 1, dtype=torch.int32, device=DEVICE)[None],
        seq_lens=torch.tensor([t], dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=DEVICE),
        attend=paged_attention_ref,
    )
    with forward_context(ctx), torch.inference_mode():
        return model(ids).logits, kv


def test_a_model_whose_layers_take_the_kernel_computes_what_the_fused_one_does() -> None:
    from engine.flat_attention import FLAT_ATTN_IMPLEMENTATION
    from engine.fused_projections import fuse_projections
    from engine.fused_rope_write import fuse_rope_writes, is_rope_write
    from engine.kernels.rope_write_triton import rope_write_kv_triton

    plain = _model()
    eager_ids = torch.randint(0, 128, (1, 13), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.inference_mode():
        reference = plain(eager_ids).logits  # transformers' own attention, no paged cache
    fuse_projections(plain)
    plain.set_attn_implementation(FLAT_ATTN_IMPLEMENTATION)
    rope = copy.deepcopy(plain)
    assert fuse_rope_writes(rope, rope_write_kv_triton) == 2
    assert all(is_rope_write(layer.self_attn) for layer in rope.model.layers)
    want, want_kv = _flat_logits(plain, eager_ids)
    got, got_kv = _flat_logits(rope, eager_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5)
    # Written, and the null block not
    assert got_kv[:, :, 1:].abs().sum() > 0 and got_kv[:, :, 0].abs().sum() == 0
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)


def test_a_layer_that_rotates_another_way_keeps_its_forward(caplog) -> None:
    from engine.flat_attention import FLAT_ATTN_IMPLEMENTATION
    from engine.fused_projections import fuse_projections
    from engine.fused_rope_write import fuse_rope_writes, is_rope_write
    from engine.kernels.rope_write_triton import rope_write_kv_triton

    def interleaved(q, k, cos, sin):  # pairs (0, 1), (2, 3), ... as GPT-J rotates them
        def rot(x):
            pairs = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
            return x * cos[:, None] + pairs * sin[:, None]

        return rot(q), rot(k)

    model = _model(layers=1)
    fuse_projections(model)
    model.set_attn_implementation(FLAT_ATTN_IMPLEMENTATION)
    attn = model.model.layers[0].self_attn
    attn.fused_rotary = interleaved
    with caplog.at_level("INFO", logger="engine.fused_rope_write"):
        assert fuse_rope_writes(model, rope_write_kv_triton) == 0
    assert not is_rope_write(attn) and not hasattr(attn, "rope_write_heads")
    assert "keeps its rotary and K/V writes: rotated queries differ" in caplog.text


def test_layers_off_the_flat_attention_are_left_alone() -> None:
    from engine.fused_projections import fuse_projections
    from engine.fused_rope_write import fuse_rope_writes
    from engine.kernels.rope_write_triton import rope_write_kv_triton

    model = _model(layers=1)
    fuse_projections(model)  # transformers' own attention: the kernel's forward would bypass it
    assert fuse_rope_writes(model, rope_write_kv_triton) == 0


@pytest.mark.skipif(DEVICE != "cuda", reason="the CUDA device's engine (the interpreter runs kernels only)")
@pytest.mark.parametrize("compile_forward", [False, True])
def test_cuda_engine_with_the_kernel_generates_what_hf_does(
    monkeypatch, hf_reference, compile_forward
) -> None:
    from engine_helpers import random_prompts, small_config

    import engine.device.cuda as cuda
    from engine.llm_engine import LLMEngine
    from engine.request import Request, SamplingParams

    monkeypatch.setattr(cuda, "ROPE_WRITE_KERNEL", True)
    engine = LLMEngine(
        small_config(device="cuda", skip_warmup=False, shape_policy="flat", compile=compile_forward)
    )
    assert engine.rope_writes == engine.loaded.model.config.num_hidden_layers
    lengths, max_tokens = [3, 17, 40, 1, 250, 9], [12, 30, 5, 20, 8, 25]
    reqs = [
        Request(f"r{i}", p, SamplingParams(max_tokens=m))
        for i, (p, m) in enumerate(zip(random_prompts(lengths, seed=1), max_tokens, strict=True))
    ]
    engine.generate(reqs)
    for r in reqs:
        expected = hf_reference(engine.loaded.path, "cuda").greedy(r.prompt_token_ids, r.sampling.max_tokens)
        assert r.output_token_ids == expected, f"{r.request_id} (prompt {r.num_prompt_tokens} tokens) differs"
    engine.check_integrity()
