"""Fused Q/K/V attention layers whose rotary embedding and K/V cache writes run as one kernel, on accelerators.

After :mod:`engine.fused_projections`, a Llama-family attention layer runs one GEMM for Q, K and V, then
transformers' rotary embedding, our attention function's copies to token-major rows and the device's K/V writer:
in a compiled batch-1 decode step four small kernels a layer besides the GEMM and the attention. Here the fused
projection's output goes to one operator, ``bucketserve::rope_write_attention``, which rotates the queries and
keys, writes keys and values to their cache slots and attends, all with the device's kernels (on CUDA
``engine/kernels/rope_write_triton.py``; the CPU's eager path has its own, :mod:`engine.fused_attention`).

Which layers take it is decided once, at start-up, after the model runs the flat attention implementation
(:func:`fuse_rope_writes`, called by ``Device.fuse_rope_writes``): a layer whose fused forward is in place and
whose own rotary (its family's ``apply_rotary_pos_emb``) the kernel reproduces on a probe (random queries, keys and
angles; rotated queries and cache contents compared to the dtype's rounding). A family that rotates another way
(interleaved pairs, a partial rotary) keeps the forward it had.
"""

from __future__ import annotations

import logging
from types import MethodType

import torch

from engine.flat_attention import FLAT_ATTN_IMPLEMENTATION, attend_rotated
from engine.forward_context import RopeWriteFn, current_context
from engine.fused_attention import probe_context, probe_rope
from engine.fused_projections import _attention_forward, fused_linear_of
from engine.kernels import paged_attention_ref
from engine.swapped_forward import runs_forward

logger = logging.getLogger(__name__)

# The device's kernel, set once at start-up by fuse_rope_writes (an operator cannot take a function argument).
_rope_write: RopeWriteFn | None = None

# How far the probe's rotated queries and keys may lie from the family's rotary, as a fraction of their largest
# magnitude: the kernel rounds as the eager ops do, so only a fused multiply-add the compiler makes may move a
# result by a unit in its last place. A family that rotates another way is off by the order of the values.
_PROBE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-9}
_PROBE_TOKENS = 5


def _rope_write_attend(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer: int,
    scale: float,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    # qkv [T, (H + 2 KVH) D]; cos/sin [T, D] -> [T, H, D]
    return attend_rotated(current_context(), layer, _rope_write, qkv, cos, sin, (heads, kv_heads), scale)


# Opaque to torch.compile, as bucketserve::flat_attention is: it mutates the cache and reads the step's context.
@torch.library.custom_op("bucketserve::rope_write_attention", mutates_args=())
def rope_write_attention_op(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer: int,
    scale: float,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    return _rope_write_attend(qkv, cos, sin, layer, scale, heads, kv_heads)


@rope_write_attention_op.register_fake
def _rope_write_attention_fake(qkv, cos, sin, layer, scale, heads, kv_heads):
    return qkv.new_empty(qkv.shape[0], heads, qkv.shape[1] // (heads + 2 * kv_heads))


def _rope_write_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    # hidden_states [1, T, hidden] (the flat runner's one row); cos/sin [1, T, D]
    shape = hidden_states.shape[:-1]
    d = self.head_dim
    qkv = self.fused_linear(hidden_states)  # [1, T, (H + 2 KVH) D]
    cos, sin = position_embeddings
    fn = rope_write_attention_op if torch.compiler.is_compiling() else _rope_write_attend
    out = fn(
        qkv.view(-1, qkv.shape[-1]), cos.reshape(-1, d), sin.reshape(-1, d), self.layer_idx, self.scaling,
        *self.rope_write_heads,
    )  # fmt: skip  # [T, H, D]
    return self.o_proj(out.view(*shape, -1)), None  # [1, T, hidden]


def is_rope_write(module: torch.nn.Module) -> bool:
    """Whether :func:`fuse_rope_writes` swapped this attention layer's forward."""
    return runs_forward(module, _rope_write_forward)


def _candidate(module: torch.nn.Module) -> bool:
    fused = fused_linear_of(module)
    return (
        fused is not None
        and fused.bias is None  # the kernel adds no bias (a biased projection's fused linear adds it: kept)
        and runs_forward(module, _attention_forward)
        and getattr(getattr(module, "config", None), "_attn_implementation", None) == FLAT_ATTN_IMPLEMENTATION
        and fused.weight.dtype in _PROBE_TOLERANCE
        and len(module.fused_widths) == 3
        and module.fused_widths[1] == module.fused_widths[2]
        and module.head_dim % 2 == 0
    )


def _disagreement(module: torch.nn.Module, rope_write: RopeWriteFn, gen: torch.Generator) -> str | None:
    """Why the kernel cannot stand in for the module's rotary and cache writes, on a probe; None if it can."""
    weight = fused_linear_of(module).weight
    dtype, device, d, t = weight.dtype, weight.device, module.head_dim, _PROBE_TOKENS
    heads, kv_heads = module.rope_write_heads
    q = torch.randn(1, heads, t, d, generator=gen).to(device, dtype)  # [1, H, T, D], as the module has them
    k = torch.randn(1, kv_heads, t, d, generator=gen).to(device, dtype)
    v = torch.randn(1, kv_heads, t, d, generator=gen).to(device, dtype)
    cos, sin = probe_rope(t, d, gen, dtype, device)  # [1, T, D]
    try:
        want_q, want_k = module.fused_rotary(q, k, cos, sin)
        qkv = torch.cat([x[0].transpose(0, 1).reshape(t, -1) for x in (q, k, v)], dim=1)  # [T, (H + 2 KVH) D]
        # The tokens in slots after the null block; the probe writes, it does not attend.
        ctx = probe_context(module, t, paged_attention_ref, layers=1)
        caches = (ctx.kv_data[0, 0], ctx.kv_data[0, 1])  # [NB + 1, BS, KVH, D] each
        got_q = rope_write(qkv, cos[0], sin[0], *caches, ctx.slot_mapping, heads, kv_heads)
    except Exception as e:  # a module this kernel cannot stand in for may fail on the probe
        return f"the probe failed: {type(e).__name__}: {e}"
    tolerance = _PROBE_TOLERANCE[dtype]
    pairs = {
        "queries": (got_q, want_q[0].transpose(0, 1)),  # [T, H, D]
        "keys": (caches[0].reshape(-1, kv_heads, d)[ctx.slot_mapping], want_k[0].transpose(0, 1)),
        "values": (caches[1].reshape(-1, kv_heads, d)[ctx.slot_mapping], v[0].transpose(0, 1)),
    }
    for what, (got, want) in pairs.items():
        error = (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-30)
        if not error <= tolerance:
            return (
                f"rotated {what} differ by {error:.3g} of their largest magnitude (at most {tolerance:.3g})"
            )
    return None


@torch.inference_mode()
def fuse_rope_writes(model: torch.nn.Module, rope_write: RopeWriteFn) -> int:
    """Give every fused-projection attention layer of ``model`` (already on the flat attention implementation) whose
    rotary ``rope_write`` reproduces the one-kernel forward; returns how many."""
    global _rope_write
    gen = torch.Generator().manual_seed(0)
    fused = kept = 0
    for module in model.modules():
        if not _candidate(module):
            continue
        q_width, kv_width, _ = module.fused_widths
        module.rope_write_heads = (q_width // module.head_dim, kv_width // module.head_dim)
        why = _disagreement(module, rope_write, gen)
        if why is not None:
            del module.rope_write_heads
            logger.info("attention layer %d keeps its rotary and K/V writes: %s", module.layer_idx, why)
            kept += 1
            continue
        module.forward = MethodType(_rope_write_forward, module)
        fused += 1
    if fused:
        _rope_write = rope_write
    if fused or kept:
        logger.info(
            "rotary and K/V writes in one kernel in %d attention layers (%d kept theirs)", fused, kept
        )
    return fused
