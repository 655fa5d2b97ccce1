"""A Triton kernel for decode steps on accelerators: each sequence's last token attends over its paged KV in place.

One program per (sequence, KV head) walks the sequence's block table, ``TILE`` blocks at a time, reading each K/V
block where it lies in the cache (no gather copy), with an online softmax in fp32; the ``G`` query heads sharing
the KV head are the rows of one ``tl.dot``. Only the blocks under ``seq_len`` are read, so the block table can be
wider than any sequence needs, and one captured graph per padded batch size serves every context length.

Imported only where Triton is installed (the CUDA device); the pure-torch operator is the fallback.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode(
    out_ptr,  # [B, H, D]
    q_ptr,  # [B, H, D]
    k_ptr,  # [NB, BS, KVH, D]
    v_ptr,  # [NB, BS, KVH, D]
    table_ptr,  # [B, W] int32
    lens_ptr,  # [B] int32
    scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_tb,
    G: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,  # G rounded up to a tl.dot row count (16)
    BS: tl.constexpr,  # tokens per block
    D: tl.constexpr,  # head dim
    TILE: tl.constexpr,  # blocks per iteration
    PRECISION: tl.constexpr,  # tl.dot's for fp32 caches: "ieee", exact fp32 (bf16/fp16 dots ignore it)
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    tok = tl.arange(0, TILE * BS)  # token offsets within one tile of TILE blocks
    heads = kvh * G + g
    g_ok = g < G
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0
    )
    # The scale goes on in fp32, then q takes the cache's dtype: bf16 dots run on tensor cores with fp32 sums.
    q = (q.to(tl.float32) * scale).to(k_ptr.dtype.element_ty)  # [G_PAD, D]
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    n_blocks = tl.cdiv(seq_len, BS)
    for first in range(0, n_blocks, TILE):
        blk_idx = first + tok // BS  # [TILE * BS]: the table entry of each token of the tile
        blk = tl.load(table_ptr + b * stride_tb + blk_idx, mask=blk_idx < n_blocks, other=0).to(tl.int64)
        pos = first * BS + tok  # [TILE * BS]: token positions
        ok = pos < seq_len
        slot = tok % BS
        k = tl.load(
            k_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
            mask=ok[:, None],
            other=0.0,
        )  # [TILE * BS, D]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [G_PAD, TILE * BS]
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])  # [G_PAD, TILE * BS]
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
            mask=ok[:, None],
            other=0.0,
        )  # [TILE * BS, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    o = acc / l_sum[:, None]
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None],
    )


def paged_decode_triton(
    out: torch.Tensor,  # [B, H, D], written
    q: torch.Tensor,  # [B, H, D]: one query token per sequence
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> None:
    b, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    if k_cache.stride(3) != 1 or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("paged_decode_triton: the head dimension must be contiguous")
    tile = max(1, 64 // bs)  # 64 tokens per iteration
    _paged_decode[(b, kvh)](
        out,
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        G=g,
        G_PAD=max(16, triton.next_power_of_2(g)),
        BS=bs,
        D=d,
        TILE=tile,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
    )
