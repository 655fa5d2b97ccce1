"""Attention kernels: the compiled CPU operator when it builds, else a pure-torch one of the same signature.

``paged_attention(out[T,H,D], q[T,H,D], k_cache[NB,BS,KVH,D], v_cache[NB,BS,KVH,D], block_table[B,W] int32,
seq_lens[B] int32, query_start_loc[B+1] int32, scale) -> None`` writes ``out``; see paged_attention_cpu.cpp.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.kernels.paged_attention_gather import paged_attention_gather
from engine.kernels.paged_attention_ref import paged_attention_ref

PagedAttentionFn = Callable[..., None]


def cpu_paged_attention() -> PagedAttentionFn:
    """The compiled kernel if this host can build it (built once, cached), else the fallback."""
    from engine.kernels.build import load

    return load() or paged_attention_ref


__all__ = ["PagedAttentionFn", "cpu_paged_attention", "paged_attention_gather", "paged_attention_ref"]
