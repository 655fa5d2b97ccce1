"""Continuous-batching policy of one worker, as a pure function over ints and lists.

Each step is either a prefill step (admit waiting requests, FCFS, up to the prefill limits and the
free KV blocks) or a decode step (every running request advances one token). Prefill goes first
when something waits and fits, because a decode batch that grows sooner makes every later step
more productive. When a decode step needs blocks that are not free, the newest running requests
are preempted (their blocks freed, recomputed later), so the oldest keep making progress.
No torch, no Ray: unit-tested without a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WaitingSeq:
    request_id: str
    num_new_tokens: int  # tokens to compute in prefill
    blocks_needed: int  # new blocks to allocate for them (plus the first decode slot)


@dataclass(frozen=True)
class RunningSeq:
    request_id: str
    blocks_needed: int  # 0 or 1: a new block for the next token
    blocks_held: int  # freed if this request is preempted


@dataclass(frozen=True)
class StepLimits:
    max_num_seqs: int
    max_num_prefill_seqs: int
    max_num_batched_tokens: int
    max_prefill_query_len: int | None = None  # largest warmed query length (None: no limit)


@dataclass(frozen=True)
class StepPlan:
    kind: str  # "prefill" | "decode" | "idle"
    request_ids: tuple[str, ...] = ()
    preempt_ids: tuple[str, ...] = ()  # running requests to push back to waiting (decode only)


def plan_step(
    waiting: Sequence[WaitingSeq],
    running: Sequence[RunningSeq],
    free_blocks: int,
    limits: StepLimits,
) -> StepPlan:
    room = limits.max_num_seqs - len(running)
    if waiting and room > 0:
        chosen: list[str] = []
        tokens = 0
        blocks = free_blocks
        for w in waiting:
            if len(chosen) >= min(room, limits.max_num_prefill_seqs):
                break
            if chosen and tokens + w.num_new_tokens > limits.max_num_batched_tokens:
                break
            # Keep one block per running request in reserve so admitting prefill cannot starve decode.
            reserve = len(running) + len(chosen)
            if w.blocks_needed > blocks - reserve:
                break
            chosen.append(w.request_id)
            tokens += w.num_new_tokens
            blocks -= w.blocks_needed
        if chosen:
            return StepPlan("prefill", tuple(chosen))
    if not running:
        return StepPlan("idle")
    # Decode: preempt newest-first until the blocks needed for one more token fit.
    keep = list(running)
    preempt: list[str] = []
    need = sum(r.blocks_needed for r in keep)
    freed = 0
    while keep and need > free_blocks + freed:
        victim = keep.pop()
        preempt.append(victim.request_id)
        need -= victim.blocks_needed
        freed += victim.blocks_held
    return StepPlan("decode", tuple(r.request_id for r in keep), tuple(preempt))
