"""Paged attention in plain torch ops with no host synchronisation on decode steps: the accelerator operator.

A step of decodes only (one query per sequence, ``T == B``) gathers each sequence's blocks by the block table and
attends with one batched matmul per phase, every shape fixed by ``(B, W)``: nothing reads a tensor back to the
host, so the step can be captured once per padded ``(batch, table width)`` and replayed (CUDA graphs). Steps
with prompt tokens run one SDPA per sequence, eagerly (causal without a mask where the sequence has no cached
context, which lets the accelerator's fused kernels run).

The gather copies the blocks the table names (``B * W * block_size`` tokens a layer); with table widths bucketed
to powers of two that is at most twice a sequence's context. Same signature and semantics as the CPU kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_gather(
    out: torch.Tensor,  # [T, H, D], written
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32, cached tokens including this step's
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
) -> None:
    b, w = block_table.shape
    t, h, d = q.shape
    if t != b:  # some sequence has several query tokens (a prompt or a chunk): per sequence, eagerly
        per_sequence_attention(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
        return
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    ids = block_table.long()  # [B, W]
    # fp32 arithmetic whatever the cache's dtype, as the CPU kernel does (bf16 scores lose the ordering of
    # close logits); at decode sizes the weights' traffic dwarfs this.
    k = k_cache[ids].view(b, w * bs, kvh, d).permute(0, 2, 3, 1).float()  # [B, KVH, D, S]
    v = v_cache[ids].view(b, w * bs, kvh, d).transpose(1, 2).float()  # [B, KVH, S, D]
    qg = q.view(b, kvh, g, d).float()  # [B, KVH, G, D]: the G query heads that share a KV head
    scores = torch.matmul(qg, k) * scale  # [B, KVH, G, S]
    # The query is the sequence's last token: it sees every cached position before seq_len.
    valid = torch.arange(w * bs, device=q.device)[None, :] < seq_lens[:, None]  # [B, S]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)  # [B, KVH, G, S]
    out.copy_(
        torch.matmul(p, v).view(b, h, d)
    )  # [B, KVH, G, D] -> [T, H, D], in out's dtype  # [B, KVH, G, D] -> [T, H, D]


def per_sequence_attention(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale) -> None:
    """One SDPA per sequence over its gathered blocks (the host reads the lengths): for steps with prompt tokens."""
    bs, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    g = q.shape[1] // kvh
    for i, (seq_len, q0, q1) in enumerate(
        zip(seq_lens.tolist(), query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(), strict=True)
    ):
        q_len = q1 - q0
        if q_len == 0:
            continue
        ids = block_table[i, : -(-seq_len // bs)].long()  # [n]
        k = k_cache[ids].view(-1, kvh, d)[:seq_len].transpose(0, 1)  # [KVH, S, D]
        v = v_cache[ids].view(-1, kvh, d)[:seq_len].transpose(0, 1)
        k = k.repeat_interleave(g, dim=0)[None]  # [1, H, S, D]
        v = v.repeat_interleave(g, dim=0)[None]
        qi = q[q0:q1].transpose(0, 1)[None]  # [1, H, Q, D]
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale)
        else:  # query j sits at position seq_len - q_len + j and sees cache positions <= it
            qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]  # [Q, 1]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos  # [Q, S]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[q0:q1] = o[0].transpose(0, 1)  # [Q, H, D]
