"""Pure-torch paged attention: the C++ kernel's signature and semantics, for hosts that cannot build it.

Per sequence (a Python loop over sequences, never over tokens): gather its blocks into contiguous K/V,
then one SDPA call with a causal mask offset by the cached context. Computes in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# sdpa(q [1, H, Q, D], k [1, KVH, S, D], v [1, KVH, S, D], mask [Q, S] bool, scale) -> [1, H, Q, D]
SdpaFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def torch_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [1, H, Q, D], k/v [1, KVH, S, D], mask [Q, S] bool (True: may attend) -> [1, H, Q, D]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def attend_per_sequence(
    sdpa: SdpaFn,
    out: torch.Tensor,  # [T, H, D], written
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32, cached tokens including this step's
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
) -> None:
    """Each sequence's blocks gathered into contiguous K/V, then one ``sdpa`` call with a causal mask offset by
    the cached context; shared by the operators whose steps with prompt tokens run this way."""
    bs, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(lens):
        q0, q1 = starts[i], starts[i + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        n_blocks = -(-seq_len // bs)
        ids = block_table[i, :n_blocks].long()  # [n]
        k = k_cache.index_select(0, ids).reshape(-1, kvh, d)[:seq_len]  # [S, KVH, D]
        v = v_cache.index_select(0, ids).reshape(-1, kvh, d)[:seq_len]
        qi = q[q0:q1].transpose(0, 1).unsqueeze(0).float()  # [1, H, Q, D]
        ki = k.transpose(0, 1).unsqueeze(0).float()  # [1, KVH, S, D]
        vi = v.transpose(0, 1).unsqueeze(0).float()
        # Query j sits at position seq_len - q_len + j and sees cache positions <= it.
        qpos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)  # [Q, 1]
        mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= qpos  # [Q, S]
        o = sdpa(qi, ki, vi, mask, scale)
        out[q0:q1] = o[0].transpose(0, 1).to(out.dtype)  # [Q, H, D]


def paged_attention_ref(
    out: torch.Tensor,  # [T, H, D], written
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32, cached tokens including this step's
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
) -> None:
    attend_per_sequence(torch_sdpa, out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
