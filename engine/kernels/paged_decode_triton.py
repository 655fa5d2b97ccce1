"""A Triton kernel for decode steps on accelerators: each sequence's last token attends over its paged KV in place.

One program per (sequence, KV head, split) walks its share of the sequence's block table, ``TILE`` blocks at a
time, reading each K/V block where it lies in the cache (no gather copy), with an online softmax in fp32; the
``G`` query heads sharing the KV head are the rows of one ``tl.dot``. Only the blocks under ``seq_len`` are read,
so the block table can be wider than any sequence needs, and one captured graph per padded batch size serves
every context length.

Few sequences give few programs (batch 1 of a model with 8 KV heads: 8 programs on a GPU of 132 SMs, each
walking the whole context), so small batches split each sequence's context into ``splits`` parts (flash
decoding): each writes its unnormalised partial output with its running max and sum, and a second kernel merges
them. The split count depends on the batch size only (a captured graph's launch grid is fixed); a part past the
end of a short context does nothing.

Imported only where Triton is installed (the CUDA device); the pure-torch operator is the fallback.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode(
    out_ptr,  # [B, H, D]
    part_o_ptr,  # [B, H, SPLITS, D] fp32: unnormalised partial outputs (SPLITS > 1 only)
    part_ml_ptr,  # [B, H, SPLITS, 2] fp32: each part's running max and sum (SPLITS > 1 only)
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
    SPLITS: tl.constexpr,  # parts each sequence's context is split into
    H: tl.constexpr,  # query heads
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
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
    n_tiles = tl.cdiv(n_blocks, TILE)
    per_split = tl.cdiv(n_tiles, SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)
    for t in range(tile_lo, tile_hi):
        first = t * TILE
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
    if SPLITS == 1:
        o = acc / l_sum[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None],
        )
    else:
        # A part with no tokens leaves m = -inf, l = 0, acc = 0: the merge weighs it 0.
        row = (b * H + heads) * SPLITS + split  # [G_PAD]
        tl.store(part_o_ptr + row[:, None] * D + d[None, :], acc, mask=g_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m, mask=g_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_sum, mask=g_ok)


@triton.jit
def _merge_splits(
    out_ptr,  # [B, H, D]
    part_o_ptr,  # [B, H, SPLITS, D] fp32
    part_ml_ptr,  # [B, H, SPLITS, 2] fp32
    stride_ob,
    stride_oh,
    SPLITS: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    row = (b * H + h) * SPLITS + s  # [SPLITS]
    m = tl.load(part_ml_ptr + row * 2)
    l_part = tl.load(part_ml_ptr + row * 2 + 1)
    acc = tl.load(part_o_ptr + row[:, None] * D + d[None, :])  # [SPLITS, D]
    m_all = tl.max(m, 0)
    # A padded batch row (seq_len 0) has every part empty: keep exp() away from -inf - -inf.
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_all)  # [SPLITS]; 0 for an empty part
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l_part * w, 0)  # [D]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


# Programs a decode step aims for before it splits contexts: about one per streaming multiprocessor of a large GPU
# (an H100 has 132), so a small batch still reads the cache with the whole GPU.
_TARGET_PROGRAMS = 128
MAX_SPLITS = 16


def decode_splits(batch: int, kv_heads: int) -> int:
    """Parts each sequence's context is split into for a decode step of ``batch`` sequences: a power of two
    (1 when the batch alone gives enough programs), from the batch size only, so a captured graph keeps it."""
    want = -(-_TARGET_PROGRAMS // max(1, batch * kv_heads))
    return min(MAX_SPLITS, triton.next_power_of_2(want)) if want > 1 else 1


def paged_decode_triton(
    out: torch.Tensor,  # [B, H, D], written
    q: torch.Tensor,  # [B, H, D]: one query token per sequence
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    splits: int | None = None,  # None: decode_splits(B, KVH)
) -> None:
    b, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    if k_cache.stride(3) != 1 or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("paged_decode_triton: the head dimension must be contiguous")
    tile = max(1, 64 // bs)  # 64 tokens per iteration
    splits = decode_splits(b, kvh) if splits is None else splits
    if splits > 1:
        part_o = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # not read or written
    _paged_decode[(b, kvh, splits)](
        out,
        part_o,
        part_ml,
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
        SPLITS=splits,
        H=h,
    )
    if splits > 1:
        _merge_splits[(b, h)](out, part_o, part_ml, out.stride(0), out.stride(1), SPLITS=splits, H=h, D=d)
