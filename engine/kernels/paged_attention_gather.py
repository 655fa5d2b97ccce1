"""Paged attention in plain torch ops with no host synchronisation on decode steps: the accelerator operator.

A step of decodes only (one query per sequence, ``T == B``) gathers each sequence's blocks by the block table and
attends with one batched matmul per phase, every shape fixed by ``(B, W)``: nothing reads a tensor back to the
host, so the step can be captured once per padded ``(batch, table width)`` and replayed (CUDA graphs). Steps
with prompt tokens go to :func:`paged_attention_ref` (one SDPA per sequence, eagerly).

The gather copies the blocks the table names (``B * W * block_size`` tokens a layer); with table widths bucketed
to powers of two that is at most twice a sequence's context. Same signature and semantics as the CPU kernel.
"""

from __future__ import annotations

import torch

from engine.kernels.paged_attention_ref import paged_attention_ref


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
    if t != b:  # some sequence has several query tokens (a prompt or a chunk)
        paged_attention_ref(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
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
    out.copy_(torch.matmul(p, v).view(b, h, d))  # [B, KVH, G, D] -> [T, H, D], in out's dtype
