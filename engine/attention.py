"""Paged attention plugged into Hugging Face models through ``transformers.AttentionInterface``.

The model classes stay transformers' own. Our function receives ``(module, query, key, value,
attention_mask, **kwargs)`` after rotary embedding; the runner passes an :class:`AttentionMetadata`
as the extra keyword ``attn_meta`` to the model's forward, and it reaches us unchanged. We write
the new K/V into the paged cache and attend over the cached context.

Prompt batches are right-padded rows ``[B, Q]``; decode batches use the flat block layout of Gaudi
practice: every block of every sequence in one list ``[NB]``, with the row each block belongs to,
so the shape depends only on the bucket ``(B, NB)``, never on individual sequence lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "bucketserve_paged"
_MASKED = -1e30  # finite, so fully masked rows give exp(0) garbage (discarded) rather than NaN


@dataclass
class AttentionMetadata:
    """Tensors describing one padded batch. Shapes in comments: B rows, Q query len, NB blocks."""

    is_prompt: bool
    kv_data: torch.Tensor  # KVCache.data: [L, 2, num_blocks + 1, block_size, KVH, D]
    slot_mapping: torch.Tensor  # [B * Q] flat slot of each new token (padding -> the null block)
    # Prompt with cached context (prefix caching / chunked prefill); None when there is none.
    ctx_block_table: torch.Tensor | None = None  # [B, C] block ids (padding -> null block)
    ctx_bias: torch.Tensor | None = None  # [B, 1, Q, C * block_size + Q] additive mask
    # Decode, flat layout.
    block_list: torch.Tensor | None = None  # [NB] block ids (padding -> null block)
    block_groups: torch.Tensor | None = None  # [NB] row of each block (padding -> B, a dummy row)
    block_bias: torch.Tensor | None = None  # [NB, 1, 1, block_size] 0 for valid slots, _MASKED else
    # Called with the layer index once that layer's new K/V are in the cache: a prefill worker
    # streams layer i to the decode worker while layers i+1.. still compute.
    on_layer_written: Callable[[int], None] | None = None


def write_slots(
    kv_data: torch.Tensor, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Write token-major K/V ``[N, KVH, D]`` into the cache slots ``slot_mapping [N]`` of one layer.
    kv_data: [L, 2, num_blocks + 1, S, KVH, D]."""
    kvh, d = key.shape[1], key.shape[2]
    kv_data[layer, 0].view(-1, kvh, d).index_copy_(0, slot_mapping, key)
    kv_data[layer, 1].view(-1, kvh, d).index_copy_(0, slot_mapping, value)


def _copy_kv(
    kv_data: torch.Tensor, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    # key/value: [B, KVH, Q, D] -> [B * Q, KVH, D] token-major, matching slot_mapping [B * Q].
    kvh, d = key.shape[1], key.shape[3]
    k = key.transpose(1, 2).reshape(-1, kvh, d)
    v = value.transpose(1, 2).reshape(-1, kvh, d)
    write_slots(kv_data, layer, slot_mapping, k, v)


# Under torch.compile (``--compile``) the write is an opaque operator that mutates the cache in place. Traced as
# plain tensor code, the in-place copy into the cache (a graph input) is functionalised and the compiled graph
# copies the whole cache back, every layer: a 256-token prefill of ``small`` with its 1 GiB CPU cache took 7.4 s
# instead of 0.26 s. Eager calls skip the operator's dispatch (about 30 us a layer on CPU).
@torch.library.custom_op("bucketserve::write_kv", mutates_args=("kv_data",))
def write_kv(
    kv_data: torch.Tensor, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    _copy_kv(kv_data, layer, slot_mapping, key, value)


@write_kv.register_fake
def _write_kv_fake(
    kv_data: torch.Tensor, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    return None


def _write_kv(meta: AttentionMetadata, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    write = write_kv if torch.compiler.is_compiling() else _copy_kv
    write(meta.kv_data, layer, meta.slot_mapping, key, value)


def _prompt_attention(meta, layer, query, key, value, scaling) -> torch.Tensor:
    # query [B, H, Q, D]; key/value [B, KVH, Q, D]
    if meta.ctx_block_table is None:
        # Right padding + causal mask: a real token never sees a padding token after it.
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
    b, kvh, q, d = key.shape
    table = meta.ctx_block_table  # [B, C]
    ctx_k = meta.kv_data[layer, 0][table]  # [B, C, S, KVH, D]
    ctx_v = meta.kv_data[layer, 1][table]
    ctx_k = ctx_k.reshape(b, -1, kvh, d).transpose(1, 2)  # [B, KVH, C*S, D]
    ctx_v = ctx_v.reshape(b, -1, kvh, d).transpose(1, 2)
    k = torch.cat([ctx_k, key], dim=2)  # [B, KVH, C*S + Q, D]
    v = torch.cat([ctx_v, value], dim=2)
    return F.scaled_dot_product_attention(
        query, k, v, attn_mask=meta.ctx_bias, scale=scaling, enable_gqa=True
    )


def _decode_attention(meta, layer, query, scaling) -> torch.Tensor:
    # query [B, H, 1, D]
    b, h, _, d = query.shape
    k_cache = meta.kv_data[layer, 0]  # [num_blocks + 1, S, KVH, D]
    v_cache = meta.kv_data[layer, 1]
    kvh = k_cache.shape[2]
    g = h // kvh
    groups = meta.block_groups  # [NB]
    q = query.reshape(b, kvh, g, d)
    q = torch.cat([q, q.new_zeros(1, kvh, g, d)])  # [B + 1, KVH, G, D]: row B is the dummy row
    qb = q.index_select(0, groups)  # [NB, KVH, G, D]
    kb = k_cache.index_select(0, meta.block_list)  # [NB, S, KVH, D]
    vb = v_cache.index_select(0, meta.block_list)  # [NB, S, KVH, D]
    # One strided bmm per KV head reads kb/vb in place; a [NB, KVH, S, D] transpose would copy them.
    scores = torch.stack([torch.bmm(qb[:, j], kb[:, :, j].transpose(1, 2)) for j in range(kvh)], 1)
    scores = scores * scaling + meta.block_bias  # [NB, KVH, G, S]
    # Softmax over all blocks of a row: per-block max -> row max, then sums, as a segment reduction.
    block_max = scores.amax(-1)  # [NB, KVH, G]
    idx = groups.view(-1, 1, 1).expand_as(block_max)
    row_max = block_max.new_full((b + 1, kvh, g), _MASKED).scatter_reduce_(0, idx, block_max, "amax")
    p = torch.exp(scores - row_max.index_select(0, groups).unsqueeze(-1))  # [NB, KVH, G, S]
    row_sum = p.new_zeros(b + 1, kvh, g).index_add_(0, groups, p.sum(-1))  # [B + 1, KVH, G]
    pv = torch.stack([torch.bmm(p[:, j], vb[:, :, j]) for j in range(kvh)], 1)  # [NB, KVH, G, D]
    out = p.new_zeros(b + 1, kvh, g, d).index_add_(0, groups, pv)  # [B + 1, KVH, G, D]
    out = out[:b] / row_sum[:b].clamp_min(1e-30).unsqueeze(-1)
    return out.reshape(b, h, 1, d)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attn_meta: AttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if attn_meta is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION} attention needs attn_meta (run the model through ModelRunner)"
        )
    layer = module.layer_idx
    _write_kv(attn_meta, layer, key, value)
    if attn_meta.on_layer_written is not None:
        attn_meta.on_layer_written(layer)
    if attn_meta.is_prompt:
        out = _prompt_attention(attn_meta, layer, query, key, value, scaling)
    else:
        out = _decode_attention(attn_meta, layer, query, scaling)
    return out.transpose(1, 2), None  # [B, Q, H, D], as transformers' attention functions return


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
