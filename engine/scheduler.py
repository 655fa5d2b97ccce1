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


# ---------------------------------------------------------------------------------------------- flat tokens


@dataclass(frozen=True)
class SeqState:
    """A request as the flat step policy sees it: ``num_tokens`` known (prompt + generated), ``num_computed``
    of them in the cache, ``blocks_held`` blocks of ``block_size`` tokens."""

    request_id: str
    num_computed: int
    num_tokens: int
    blocks_held: int


@dataclass(frozen=True)
class FlatLimits:
    max_num_seqs: int
    max_num_batched_tokens: int  # the step's token budget
    block_size: int


@dataclass(frozen=True)
class FlatPlan:
    scheduled: tuple[tuple[str, int], ...] = ()  # (request id, tokens this step computes), in batch order
    preempt_ids: tuple[str, ...] = ()  # running requests pushed back to waiting (their blocks freed)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def _new_blocks(s: SeqState, n: int, block_size: int) -> int:
    return max(0, -(-(s.num_computed + n) // block_size) - s.blocks_held)


def plan_flat_step(
    running: Sequence[SeqState],
    waiting: Sequence[SeqState],
    free_blocks: int,
    limits: FlatLimits,
    prompt_cap: int | None = None,
) -> FlatPlan:
    """One step of flat tokens under a token budget: every running request first (its decode token, or for a
    request part-way through its prompt the next chunk of it, decodes before chunks), then waiting requests in
    order, each with as much of its prompt as the budget and the free blocks allow (chunked prefill). When the
    running requests' blocks do not fit, the newest are preempted, so the oldest keep making progress. A waiting
    request is admitted only with one free block left per request already in the step, so admitting prefill
    work cannot starve the next decode step; nothing behind a waiting request that does not fit is admitted
    (FCFS).
    ``prompt_cap`` (the TPOT guard's, ``engine/tpot_guard.py``) bounds the step's prompt tokens, not its
    decodes: a running request part-way through its prompt may get none and wait for a later step."""
    bs = limits.block_size
    budget = limits.max_num_batched_tokens
    cap = budget if prompt_cap is None else min(budget, prompt_cap)
    keep = list(running)
    preempt: list[str] = []
    # Running requests want all their remaining tokens this step within the budget: the decodes (one token each)
    # first, then the next chunks of the prompts part-way through, within the prompt cap too.
    while True:
        wants, tokens, prompt = [], 0, 0
        for s in keep:
            if s.num_tokens - s.num_computed == 1 and tokens < budget:
                wants.append((s, 1))
                tokens += 1
        for s in keep:
            left = s.num_tokens - s.num_computed
            n = min(left, budget - tokens, cap - prompt)
            if left > 1 and n > 0:
                wants.append((s, n))
                tokens += n
                prompt += n
        need = sum(_new_blocks(s, n, bs) for s, n in wants)
        if need <= free_blocks or not keep:
            break
        victim = keep.pop()
        preempt.append(victim.request_id)
        free_blocks += victim.blocks_held
    scheduled = [(s.request_id, n) for s, n in wants]
    free = free_blocks - need
    room = limits.max_num_seqs - len(keep)
    for s in waiting:
        left = min(budget - tokens, cap - prompt)
        if room <= 0 or left <= 0:
            break
        # As many of its tokens as fit in the budget and in the free blocks, keeping one block in reserve
        # per request already scheduled.
        spare = free - len(scheduled)
        fit = (s.blocks_held + spare) * bs - s.num_computed
        n = min(s.num_tokens - s.num_computed, left, fit)
        if n <= 0:
            break
        scheduled.append((s.request_id, n))
        tokens += n
        prompt += n
        free -= _new_blocks(s, n, bs)
        room -= 1
    return FlatPlan(tuple(scheduled), tuple(preempt))
