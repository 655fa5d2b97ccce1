"""Fresh prompts through torch's fused attention (or our AMX kernel), the rest of the step through the paged kernel.

A *fresh* sequence is one with no cached context before this step (its query length equals its sequence
length): a whole prompt, or the first chunk of one. Its attention is plain causal self-attention over its own
new K/V, which ``torch.nn.functional.scaled_dot_product_attention`` computes with torch's CPU flash kernel. On
a CPU with AMX, that kernel multiplies bf16/fp16 tiles on the matrix unit, while ours widens K/V to fp32 and
runs on the vector units. Measured on a 2-core Xeon with AVX-512 and AMX (one prompt, 8 query heads, 4 KV
heads, head dim 64, bf16 in 16-slot blocks, SDPA's time including the gather of K/V out of the blocks), ours /
SDPA on two threads: 0.36-0.41 at 32 tokens, 0.65-0.71 at 64, 0.86-0.94 at 128, 1.04-1.14 at 192, 1.03-1.20 at
256, 1.07-1.31 at 512, 1.49-1.84 at 1024, 2.16-2.19 at 2048 (two runs, after the rework of our kernel's prefill
GEMMs; before it 1.27 at 128 and 2.61 at 1024). On one thread SDPA wins from 96 tokens (1.12; 1.33 at 256, 1.76
at 1024). In fp32 ours is faster at every length (0.30 at 32 tokens, 0.57 at 256, 0.77 at 2048), so the engine
takes this path only for 16-bit caches on an AMX CPU (:meth:`engine.device.cpu.CpuDevice.paged_attention`).
Where our AMX kernel runs (``engine/kernels/fresh_attention_amx.cpp``: bf16, head dims a multiple of 32), a bf16
prompt goes to it instead of SDPA: 0.67-0.81 of SDPA's time from 128 to 1024 tokens, 0.89-0.92 at 2048, on the
same host and geometry.

Everything else (decodes, later chunks, short prompts) stays on the paged kernel, one call per run of
consecutive such sequences in the step: the kernel takes any contiguous slice of the step's metadata, since
``query_start_loc`` holds absolute token offsets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels import PagedAttentionFn

# From this many tokens a fresh prompt goes to SDPA (the measured crossover is between 64 and 128).
FRESH_MIN_TOKENS = 128
# From this many a fresh bf16 prompt goes to our AMX kernel where it runs: against the paged kernel on the same
# Xeon (one prompt, `small`'s heads, 16-slot blocks, paired), 1.04 / 1.00 / 0.97 of its time at 16 / 32 / 48
# tokens, 0.88 at 64, 0.79 at 96, 0.76 at 128, 0.68 at 192 (one thread: 0.99 at 16, 0.87 at 32, 0.78 at 64).
FRESH_AMX_MIN_TOKENS = 64


class FreshPrefillAttention:
    """A paged-attention operator (same signature as the kernel it wraps) that sends fresh prompts of at least
    ``min_tokens`` tokens to SDPA, or, where ``amx`` is given and runs the step (``fresh_attention_amx``: bf16 caches,
    head dims a multiple of 32), those of at least ``amx_min_tokens`` to it. ``calls`` counts the prompts it sent to
    either (tests and logs read it)."""

    def __init__(
        self,
        paged: PagedAttentionFn,
        min_tokens: int = FRESH_MIN_TOKENS,
        amx: Callable[..., None] | None = None,
        amx_min_tokens: int = FRESH_AMX_MIN_TOKENS,
    ) -> None:
        if min_tokens < 1 or amx_min_tokens < 1:
            raise ValueError(
                f"min_tokens and amx_min_tokens must be >= 1, got {min_tokens}, {amx_min_tokens}"
            )
        self.paged = paged
        self.min_tokens = min_tokens
        self.amx = amx
        self.amx_min_tokens = amx_min_tokens
        self.calls = 0
        # Every layer of a step passes the same metadata tensors (the runner builds them anew for each step): the
        # split is read from them once per step.
        self._split_of: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._split: tuple[list[int], list[int], list[int]] = ([], [], [])

    def _takes_amx(self, k_cache: torch.Tensor) -> bool:
        return self.amx is not None and k_cache.dtype == torch.bfloat16 and k_cache.shape[-1] % 32 == 0

    def _split_for(
        self, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, min_tokens: int
    ) -> tuple[list[int], list[int], list[int]]:
        """(query starts, sequence lengths, indices of the fresh sequences of at least ``min_tokens``) of this
        step's metadata."""
        of = self._split_of
        if of is None or of[0] is not seq_lens or of[1] is not query_start_loc or of[2] != min_tokens:
            starts, lens = query_start_loc.tolist(), seq_lens.tolist()
            fresh = [i for i, n in enumerate(lens) if n >= min_tokens and starts[i + 1] - starts[i] == n]
            # The references keep the tensors alive, so a later step's tensors cannot reuse their identity.
            self._split_of, self._split = (seq_lens, query_start_loc, min_tokens), (starts, lens, fresh)
        return self._split

    def __call__(
        self,
        out: torch.Tensor,  # [T, H, D], written
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [NB, BS, KVH, D]
        v_cache: torch.Tensor,  # [NB, BS, KVH, D]
        block_table: torch.Tensor,  # [B, W] int32
        seq_lens: torch.Tensor,  # [B] int32
        query_start_loc: torch.Tensor,  # [B + 1] int32
        scale: float,
    ) -> None:
        amx = self._takes_amx(k_cache)
        starts, lens, fresh = self._split_for(
            seq_lens, query_start_loc, self.amx_min_tokens if amx else self.min_tokens
        )
        if not fresh:
            self.paged(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)
            return
        begin = 0
        for i in [*fresh, len(lens)]:
            if i > begin:  # sequences begin .. i-1: one kernel call on their slice of the metadata
                self.paged(
                    out, q, k_cache, v_cache, block_table[begin:i], seq_lens[begin:i],
                    query_start_loc[begin : i + 1], scale,
                )  # fmt: skip
            if i < len(lens):
                self._attend_fresh(out, q, k_cache, v_cache, block_table[i], starts[i], lens[i], scale, amx)
            begin = i + 1

    def _attend_fresh(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        blocks: torch.Tensor,  # [W] int32: the sequence's block ids
        start: int,
        n: int,
        scale: float,
        amx: bool,
    ) -> None:
        self.calls += 1
        if amx:
            self.amx(out, q, k_cache, v_cache, blocks, start, n, scale)
            return
        bs = k_cache.shape[1]
        idx = blocks[: -(-n // bs)].long()
        # Its K/V were written to the cache this step; gathered back as [1, KVH, n, D] (a small copy next to
        # the n^2 attention).
        k = k_cache.index_select(0, idx).flatten(0, 1)[:n].transpose(0, 1)[None]
        v = v_cache.index_select(0, idx).flatten(0, 1)[:n].transpose(0, 1)[None]
        qs = q[start : start + n].transpose(0, 1)[None]  # [1, H, n, D]
        o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out[start : start + n].copy_(o[0].transpose(0, 1))  # [n, H, D]
