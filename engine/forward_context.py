"""The per-step forward context of the flat-token runner: what the attention operator needs besides q/k/v.

The runner sets it around each forward pass; the attention operator (:mod:`engine.flat_attention`) reads it.
Block tables, sequence lengths and slot mappings never enter the model's ``forward`` as arguments, so a
compiled graph depends on the token count only, whatever the mix of sequences in the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.attention import write_slots

# paged_attention(out[T,H,D], q[T,H,D], k_cache[NB,BS,KVH,D], v_cache[NB,BS,KVH,D], block_table[B,W],
#                 seq_lens[B], query_start_loc[B+1], scale) -> None; the device's operator.
AttendFn = Callable[..., None]
# write(kv_data[L,2,NB+1,BS,KVH,D], layer, slot_mapping[T], key[T,KVH,D], value[T,KVH,D]) -> None: the device's
# K/V writer (``Device.kv_writer``).
WriteFn = Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor], None]
# rope_write(qkv[T, (H + 2 KVH) D], cos[T, D], sin[T, D], k_cache[NB, BS, KVH, D], v_cache, slot_mapping[T],
#            num_heads, num_kv_heads) -> q[T, H, D]: a fused Q/K/V projection's queries and keys rotated, its keys
# and values written to their slots (the CPU's bucketserve_cpu::rope_write_kv, CUDA's rope_write_kv_triton).
RopeWriteFn = Callable[..., torch.Tensor]


@dataclass
class ForwardContext:
    kv_data: torch.Tensor  # KVCache.data: [L, 2, num_blocks + 1, block_size, KVH, D]
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_table: torch.Tensor  # [B, W] int32: block ids of each sequence (unused tail: the null block)
    seq_lens: torch.Tensor  # [B] int32: cached tokens of each sequence after this step's are written
    query_start_loc: torch.Tensor  # [B + 1] int32: first token of each sequence in the flat batch
    attend: AttendFn
    # Called with a layer's index once its new K/V are in the cache (a prefill worker streams layer i to the
    # decode worker while the layers after it compute).
    on_layer_written: Callable[[int], None] | None = None
    write: WriteFn = write_slots  # writes a layer's new K/V into the cache; the runner sets the device's


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def current_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("the flat attention operator runs only inside a forward_context (FlatRunner)")
    return _current
