"""Paged attention on flat tokens, plugged into Hugging Face models through ``transformers.AttentionInterface``.

The runner feeds the model one row of ``T`` tokens (every sequence of the step back to back, no padding). Our
function gets ``query [1, H, T, D]`` and ``key``/``value [1, KVH, T, D]`` after rotary embedding and calls one
opaque operator, ``bucketserve::flat_attention``, which writes the new K/V into the paged cache and attends
over each sequence's cached context in place, reading the block tables from the step's forward context. So a
compiled graph sees only ``[T, ...]`` tensors, and one graph serves every mix of decodes and prefill chunks.
transformers builds no attention mask for an implementation it does not know, so none is made for ``T``.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from engine.forward_context import ForwardContext, RopeWriteFn, current_context

FLAT_ATTN_IMPLEMENTATION = "bucketserve_flat"


def attend_written_layer(
    ctx: ForwardContext,
    layer: int,
    query: torch.Tensor,
    scale: float,
    caches: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Once ``layer``'s new K/V are in the cache: report it (``on_layer_written``), then attend over the paged
    cache. query [T, H, D] -> out [T, H, D]. ``caches``: the layer's K and V caches where the caller already
    holds them (else taken from ``ctx.kv_data``)."""
    if ctx.on_layer_written is not None:
        ctx.on_layer_written(layer)
    out = torch.empty_like(query)  # [T, H, D]
    # [NB + 1, BS, KVH, D] each
    k_cache, v_cache = caches if caches is not None else (ctx.kv_data[layer, 0], ctx.kv_data[layer, 1])
    ctx.attend(out, query, k_cache, v_cache, ctx.block_table, ctx.seq_lens, ctx.query_start_loc, scale)
    return out


def attend_rotated(
    ctx: ForwardContext,
    layer: int,
    rope_write: RopeWriteFn,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: tuple[int, int],
    scale: float,
) -> torch.Tensor:
    """A fused Q/K/V projection's output into ``layer``'s cache and through attention: ``rope_write`` rotates the
    queries and keys and writes keys and values, then :func:`attend_written_layer`. qkv [T, (H + 2 KVH) D],
    cos/sin [T, D], heads (H, KVH) -> out [T, H, D]."""
    caches = (ctx.kv_data[layer, 0], ctx.kv_data[layer, 1])  # [NB + 1, BS, KVH, D] each
    q = rope_write(qkv, cos, sin, *caches, ctx.slot_mapping, *heads)  # [T, H, D]
    return attend_written_layer(ctx, layer, q, scale, caches)


def _write_and_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float):
    # query [T, H, D]; key/value [T, KVH, D]
    ctx = current_context()
    ctx.write(ctx.kv_data, layer, ctx.slot_mapping, key, value)
    return attend_written_layer(ctx, layer, query, scale)


# Opaque to torch.compile: it mutates the cache (a tensor the graph never sees) and reads the context, so the
# traced graph keeps it as one call and never specialises on the batch's sequence lengths.
@torch.library.custom_op("bucketserve::flat_attention", mutates_args=())
def flat_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    return _write_and_attend(query, key, value, layer, scale)


@flat_attention_op.register_fake
def _flat_attention_fake(query, key, value, layer, scale):
    return torch.empty_like(query)


def flat_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    # query [1, H, T, D]; key/value [1, KVH, T, D]
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).contiguous()  # [T, KVH, D]
    v = value[0].transpose(0, 1).contiguous()
    scale = float(scaling if scaling is not None else q.shape[-1] ** -0.5)
    # Eager calls skip the operator's dispatch (tens of microseconds a layer on CPU).
    fn = flat_attention_op if torch.compiler.is_compiling() else _write_and_attend
    out = fn(q, k, v, module.layer_idx, scale)  # [T, H, D]
    return out.unsqueeze(0), None  # [1, T, H, D], as transformers' attention functions return


AttentionInterface.register(FLAT_ATTN_IMPLEMENTATION, flat_attention)
