"""The dispatcher's ledger of one worker: the KV blocks it has promised, and (prefill) the batches it holds."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerLedger:
    worker_id: str
    total_blocks: int
    reserved: dict[str, int] = field(default_factory=dict)  # request id -> blocks promised
    outstanding: dict[int, tuple[str, ...]] = field(default_factory=dict)  # prefill: batch id -> request ids
    alive: bool = True

    def free_blocks(self, reported_free: int | None) -> int:
        """Blocks not promised here, capped by the worker's own report (which may lag a step behind)."""
        own = self.total_blocks - sum(self.reserved.values())
        return max(0, own if reported_free is None else min(own, reported_free))

    def reserved_blocks(self) -> int:
        return sum(self.reserved.values())
