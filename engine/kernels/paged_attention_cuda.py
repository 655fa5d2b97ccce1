"""The CUDA paged-attention operator (same signature and semantics as the CPU kernel).

- Decode steps (one query per sequence): the Triton kernel, which reads each block in place and never syncs with
  the host, so the step is captured as a graph per padded batch size.
- Steps with prompt tokens: flash attention on variable-length sequences (``torch.nn.attention.varlen``) over
  K/V gathered from the cache into one packed row, causal from the bottom right (each sequence's queries are its
  last tokens); where this torch has no such function, or refuses the dtype (fp32), the reference operator
  (one SDPA per sequence).
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch

from engine.kernels.paged_attention_ref import paged_attention_ref
from engine.kernels.paged_decode_triton import paged_decode_triton

logger = logging.getLogger(__name__)

_varlen_ok: dict[torch.dtype, bool] = {}  # dtype -> whether varlen attention runs and agrees with SDPA here


def paged_attention_cuda(
    out: torch.Tensor,  # [T, H, D], written
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32, cached tokens including this step's
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
) -> None:
    if q.shape[0] == block_table.shape[0]:  # every sequence has one query: a decode step
        paged_decode_triton(out, q, k_cache, v_cache, block_table, seq_lens, scale)
    elif _varlen_works(q.dtype, q.device):
        varlen_prefill(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
    else:
        paged_attention_ref(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)


@functools.cache
def _varlen_options() -> dict | None:
    """Keyword arguments for a causal GQA call of this torch's ``varlen_attn``; None where it has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kw: dict = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal, aligned to the end of the keys
    elif "is_causal" in params:
        kw["is_causal"] = True
    else:
        return None
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    return kw


@dataclass
class _PackedKeys:
    """Where each sequence's keys are, packed back to back: computed once per step (the host reads the lengths,
    a sync), then reused by every layer, which gets the same metadata tensors."""

    block_table: torch.Tensor  # the step's tensors it was computed from (identity: same step)
    seq_lens: torch.Tensor
    slots: torch.Tensor  # [sum(seq_lens)] cache slot of each packed key
    cu_k: torch.Tensor  # [B + 1] int32
    max_q: int
    max_k: int


_last_packed: _PackedKeys | None = None


def _packed_keys(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, bs: int):
    global _last_packed
    last = _last_packed
    if last is not None and last.block_table is block_table and last.seq_lens is seq_lens:
        return last
    b = seq_lens.shape[0]
    host = torch.cat([seq_lens, query_start_loc]).tolist()  # one read-back for the step
    lens, starts = host[:b], host[b:]
    max_k = max(lens)
    pos = torch.arange(max_k, device=seq_lens.device)  # [S]
    slots = block_table.long()[:, pos // bs] * bs + pos % bs  # [B, S]
    cu_k = torch.zeros(b + 1, dtype=torch.int32, device=seq_lens.device)
    cu_k[1:] = seq_lens.cumsum(0)
    _last_packed = _PackedKeys(
        block_table=block_table,
        seq_lens=seq_lens,
        slots=slots[pos[None, :] < seq_lens[:, None]],  # [sum(lens)]
        cu_k=cu_k,
        max_q=max(q1 - q0 for q0, q1 in zip(starts[:-1], starts[1:], strict=True)),
        max_k=max_k,
    )
    return _last_packed


def varlen_prefill(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale) -> None:
    from torch.nn.attention.varlen import varlen_attn

    bs, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    meta = _packed_keys(block_table, seq_lens, query_start_loc, bs)
    k = k_cache.view(-1, kvh, d).index_select(0, meta.slots)  # [sum(lens), KVH, D]
    v = v_cache.view(-1, kvh, d).index_select(0, meta.slots)
    kw = _varlen_options()
    if "enable_gqa" not in kw and q.shape[1] != kvh:
        k = k.repeat_interleave(q.shape[1] // kvh, dim=1)
        v = v.repeat_interleave(q.shape[1] // kvh, dim=1)
    out.copy_(varlen_attn(q, k, v, query_start_loc, meta.cu_k, meta.max_q, meta.max_k, scale=scale, **kw))


def _varlen_works(dtype: torch.dtype, device: torch.device) -> bool:
    """Probe once per dtype: a chunk on top of cached context through varlen, against per-sequence SDPA."""
    if dtype not in _varlen_ok:
        ok = False
        if _varlen_options() is not None:
            try:
                ok = _probe(dtype, device)
            except Exception as e:  # noqa: BLE001 - any failure means: not on this build
                logger.info(
                    "varlen attention unavailable for %s (%s); prompts run one SDPA per sequence", dtype, e
                )
        _varlen_ok[dtype] = ok
        logger.info("prompt attention for %s: %s", dtype, "flash varlen" if ok else "SDPA per sequence")
    return _varlen_ok[dtype]


def _probe(dtype: torch.dtype, device: torch.device) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    bs, kvh, h, d = 16, 2, 4, 64
    k_cache = torch.randn(8, bs, kvh, d, generator=g, device=device).to(dtype)
    v_cache = torch.randn(8, bs, kvh, d, generator=g, device=device).to(dtype)
    table = torch.tensor([[3, 1, 0], [5, 2, 7]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([40, 19], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 7, 26], dtype=torch.int32, device=device)  # 7 and 19 query tokens
    q = torch.randn(26, h, d, generator=g, device=device).to(dtype)
    got, want = torch.empty_like(q), torch.empty_like(q)
    varlen_prefill(got, q, k_cache, v_cache, table, seq_lens, starts, 0.125)
    paged_attention_ref(want, q, k_cache, v_cache, table, seq_lens, starts, 0.125)
    return bool(torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2))
