"""Paged attention in the flat block layout of Gaudi practice, behind the flat-token operator's signature.

A decode step (one query per sequence, ``T == B``) works on blocks, not sequences: the table's ``B * W`` entries
are one block list; each query goes to its blocks, and each sequence's results come back from its blocks, through
matmuls with a one-hot block-to-sequence mapping (work for Gaudi's matrix engine, where index scatters would
run on its vector cores); the softmax is taken per block against its sequence's max. Every shape is fixed by
``(B, W)`` and nothing is read back to the host, so a device that caches compiled graphs by shape compiles one per
``(batch, width)`` bucket, whatever the sequences' lengths.

A step with prompt tokens attends sequence by sequence over its gathered context with the SDPA it is given:
Gaudi's fused kernel (``FusedSDPA``, through :func:`fused_sdpa_adapter`) on an HPU, torch's elsewhere.

Same signature and semantics as the CPU kernel (:mod:`engine.kernels`); computes in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kernels.paged_attention_ref import SdpaFn, attend_per_sequence, torch_sdpa

# Finite, so a row with no valid slot (a padding row) gives finite garbage, never a NaN that the block-to-sequence
# matmul would spread to every sequence (0 * NaN is NaN).
_MASKED = -1e30


def fused_sdpa_adapter(fused_apply: Callable[..., torch.Tensor]) -> SdpaFn:
    """An :data:`SdpaFn` over ``FusedSDPA.apply(q, k, v, attn_mask, dropout_p, is_causal, scale, softmax_mode,
    recompute_mode, valid_sequence_lengths, padding_side)`` of ``habana_frameworks.torch.hpex.kernels``, which
    wants as many K/V heads as query heads: grouped K/V heads are repeated first. Exact softmax ("None", not
    "fast"), no recompute (inference), no padding (each sequence's context is gathered to its own length)."""

    def sdpa(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)  # [1, H, S, D]
            v = v.repeat_interleave(group, dim=1)
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, _MASKED)  # [Q, S]
        return fused_apply(q, k, v, bias[None, None], 0.0, False, scale, "None", False, None, "right")

    return sdpa


def make_paged_attention_blocks(sdpa: SdpaFn = torch_sdpa) -> Callable[..., None]:
    """The operator, with ``sdpa`` for the steps that hold prompt tokens."""

    def paged_attention_blocks(
        out: torch.Tensor,  # [T, H, D], written
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [NB, BS, KVH, D]
        v_cache: torch.Tensor,  # [NB, BS, KVH, D]
        block_table: torch.Tensor,  # [B, W] int32
        seq_lens: torch.Tensor,  # [B] int32, cached tokens including this step's
        query_start_loc: torch.Tensor,  # [B + 1] int32
        scale: float,
    ) -> None:
        if q.shape[0] == block_table.shape[0]:
            _decode(out, q, k_cache, v_cache, block_table, seq_lens, scale)
        else:  # some sequence has several query tokens (a prompt or a chunk)
            attend_per_sequence(sdpa, out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)

    return paged_attention_blocks


def _decode(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    b, w = block_table.shape
    _, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    nb = b * w
    dev = q.device
    entry = torch.arange(nb, device=dev)  # [NB]: table entry n is column n % W of row n // W
    mapping = (entry[:, None] // w == torch.arange(b, device=dev)[None, :]).float()  # [NB, B] one-hot
    blocks = block_table.reshape(nb).long()  # [NB]
    kb = k_cache.index_select(0, blocks).float()  # [NB, BS, KVH, D]
    vb = v_cache.index_select(0, blocks).float()
    # Slot j of entry n holds position (n % W) * BS + j of its sequence; valid below the sequence's length.
    pos = (entry % w)[:, None] * bs + torch.arange(bs, device=dev)[None, :]  # [NB, BS]
    lens = mapping @ seq_lens.float()  # [NB]: each entry's sequence length (exact: lengths < 2**24)
    valid = pos < lens[:, None]  # [NB, BS]
    # Slots past the end hold whatever the block held before (or the null block's scratch): keep them out of
    # the sums entirely, since 0 * NaN would not.
    vb = vb.masked_fill(~valid[:, :, None, None], 0.0)
    qb = (mapping @ q.reshape(b, h * d).float()).view(nb, kvh, g, d)  # batch to block
    scores = torch.matmul(qb, kb.permute(0, 2, 3, 1)) * scale  # [NB, KVH, G, BS]
    scores = scores.masked_fill(~valid[:, None, None, :], _MASKED)
    row_max = scores.amax(-1).view(b, w, kvh, g).amax(1)  # [B, KVH, G]
    block_row_max = (mapping @ row_max.view(b, kvh * g)).view(nb, kvh, g, 1)  # batch to block
    p = torch.exp(scores - block_row_max)  # [NB, KVH, G, BS]; 0 at masked slots of a real sequence
    row_sum = mapping.t() @ p.sum(-1).view(nb, kvh * g)  # [B, KVH * G]: block to batch
    pv = torch.matmul(p, vb.permute(0, 2, 1, 3))  # [NB, KVH, G, D]
    o = mapping.t() @ pv.reshape(nb, kvh * g * d)  # [B, KVH * G * D]: block to batch
    o = o.view(b, kvh, g, d) / row_sum.view(b, kvh, g, 1)
    out.copy_(o.view(b, h, d))  # the G query heads of KV head j are heads j * G .. j * G + G - 1
