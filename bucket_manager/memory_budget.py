"""Memory-safe batch sizing (BucketServe Eq. 5-6), counted in KV blocks so it matches the paged cache exactly.

The paper bounds a batch by ``M_safe = 0.9 * M_remain`` and ``N_max = max{N : sum_{i<=N} S_i <= M_safe /
(2 L H D B)}``. With a paged cache the unit is a block of ``block_size`` tokens, so a request of ``S`` tokens
needs ``ceil(S / block_size)`` blocks and the safe budget is ``floor(0.9 * free_blocks)`` of the worker the batch
goes to. Figures come from the monitor's latest report; :func:`blocks_from_bytes` turns remaining bytes into
blocks when only bytes are known.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

SAFETY = 0.9


@dataclass(frozen=True)
class ModelGeometry:
    """What one token's KV costs: ``2 * layers * kv_heads * head_dim * bytes``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def safe_blocks(free_blocks: int, safety: float = SAFETY) -> int:
    """``M_safe`` in blocks: the share of the free blocks a batch may take."""
    return max(0, math.floor(safety * free_blocks))


def blocks_from_bytes(remaining_bytes: int, geometry: ModelGeometry, block_size: int) -> int:
    """Whole KV blocks that fit in ``M_remain`` bytes (memory left after weights and graphs)."""
    return max(0, remaining_bytes // (geometry.kv_bytes_per_token * block_size))


def n_max(lengths: Iterable[int], budget_blocks: int, block_size: int) -> int:
    """Eq. 6: how many of these sequences, taken in order, fit in ``budget_blocks``."""
    used = 0
    count = 0
    for length in lengths:
        used += blocks_for(length, block_size)
        if used > budget_blocks:
            break
        count += 1
    return count


@dataclass(frozen=True)
class WorkerLoad:
    """What placement needs of a worker: its free KV blocks and its queue (the monitor's full record is
    ``monitor.records.WorkerStats``)."""

    worker_id: str
    free_blocks: int
    queue_len: int = 0

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must be a non-empty string")
        if not isinstance(self.free_blocks, int) or self.free_blocks < 0:
            raise ValueError(f"free_blocks must be an int >= 0, got {self.free_blocks!r}")
        if not isinstance(self.queue_len, int) or self.queue_len < 0:
            raise ValueError(f"queue_len must be an int >= 0, got {self.queue_len!r}")


@dataclass(frozen=True)
class MemoryBudget:
    """The limits one prefill batch must respect: KV blocks on its prefill and its decode worker, tokens.

    ``reserve_output``: count a request's whole ``prompt + max_tokens`` on the decode worker (it can never run
    out of blocks mid-generation); otherwise only ``prompt + 1`` (more admitted, preemption possible).
    """

    block_size: int
    prefill_free_blocks: int
    decode_free_blocks: int
    max_num_batched_tokens: int
    safety: float = SAFETY
    reserve_output: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("prefill_free_blocks", "decode_free_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not 0.0 < self.safety <= 1.0:
            raise ValueError(f"safety must be in (0, 1], got {self.safety!r}")

    @property
    def prefill_blocks(self) -> int:
        return safe_blocks(self.prefill_free_blocks, self.safety)

    @property
    def decode_blocks(self) -> int:
        return safe_blocks(self.decode_free_blocks, self.safety)

    def prefill_need(self, prompt_len: int) -> int:
        return blocks_for(prompt_len, self.block_size)

    def decode_need(self, prompt_len: int, max_tokens: int) -> int:
        return blocks_for(prompt_len + (max_tokens if self.reserve_output else 1), self.block_size)

    def capacity(self, mean_prompt_len: float, mean_max_tokens: float, largest_batch: int) -> int:
        """``N_max`` for a typical request: the batch size memory, tokens and warmed shapes all allow (>= 1).

        This is the threshold :meth:`RequestBuckets.adjust` splits at: a bucket holding more requests than one
        batch can take is worth splitting so each batch is more uniform in length.
        """
        mean_len = max(1, math.ceil(mean_prompt_len))
        mean_out = max(1, math.ceil(mean_max_tokens))
        by_prefill = self.prefill_blocks // self.prefill_need(mean_len)
        by_decode = self.decode_blocks // self.decode_need(mean_len, mean_out)
        by_tokens = self.max_num_batched_tokens // mean_len
        return max(1, min(by_prefill, by_decode, by_tokens, largest_batch))

    @classmethod
    def for_workers(
        cls,
        prefill: WorkerLoad,
        decode: WorkerLoad,
        block_size: int,
        max_num_batched_tokens: int,
        **options,
    ) -> MemoryBudget:
        return cls(
            block_size=block_size,
            prefill_free_blocks=prefill.free_blocks,
            decode_free_blocks=decode.free_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            **options,
        )


def choose_workers(
    prefill: Iterable[WorkerLoad], decode: Iterable[WorkerLoad]
) -> tuple[WorkerLoad, WorkerLoad]:
    """Prefill: the shortest queue (then most free blocks); decode: the most free KV blocks (then shortest queue)."""
    prefill_list, decode_list = list(prefill), list(decode)
    if not prefill_list:
        raise ValueError("prefill workers must not be empty")
    if not decode_list:
        raise ValueError("decode workers must not be empty")
    p = min(prefill_list, key=lambda w: (w.queue_len, -w.free_blocks, w.worker_id))
    d = min(decode_list, key=lambda w: (-w.free_blocks, w.queue_len, w.worker_id))
    return p, d
