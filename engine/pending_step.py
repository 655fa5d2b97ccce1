"""A decode step launched but not yet read back: the overlapped decode loop's one piece of state.

With ``overlap_decode`` on, the engine queues decode step N+1 behind step N with N's tokens still on the device
(:meth:`engine.flat_runner.FlatRunner.decode_ahead`), then waits for N's tokens and does its bookkeeping (append,
stop checks, outputs) while N+1 runs. A request that finishes at step N was computed once more in N+1; that
result is dropped, and the request's blocks are freed only once N+1 has run, because N+1 writes one K/V slot in
them (a block freed earlier could be handed to a new request while that write is still queued).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.request import Request


@dataclass
class PendingStep:
    reqs: list[Request]  # in the step's row order
    tokens: torch.Tensor  # [B] int64 on the device: the greedy token of each row
    host_tokens: torch.Tensor  # [B] int64 on the host, valid after wait()
    wait: Callable[[], None]
    # Requests of this step that finished (or were aborted) while it was in flight: released after it ran.
    release_after: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ids = {r.request_id for r in self.reqs}

    def holds(self, req: Request) -> bool:
        return req.request_id in self.ids
