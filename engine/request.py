"""The one request type that flows through the engine, the workers and the scheduler.

Typed messages at process boundaries (gateway -> controller -> workers) convert to and from
:class:`Request` at the edge; inside a process everything speaks ``Request``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

# One priority class for every layer; the controller's module is the lowest that needs it.
from bucket_manager.request import PriorityClass

__all__ = ["FinishReason", "PriorityClass", "Request", "RequestOutput", "RequestStatus", "SamplingParams"]


class RequestStatus(enum.StrEnum):
    WAITING = "waiting"  # queued for prefill
    PREFILLED = "prefilled"  # first token sampled, KV written; waiting to join a decode batch
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # cancelled by the client or the system
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if isinstance(self.stop, (str, list)):
            object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    """A request and its sequence state. Counters:

    - ``num_prompt_tokens``: length of the prompt;
    - ``num_computed_tokens``: tokens whose K/V are in the cache;
    - ``num_generated_tokens`` (= ``len(output_token_ids)``): sampled tokens.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority_class: PriorityClass = PriorityClass.ONLINE
    priority: int = 0  # smaller runs first inside its class, as in the controller
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_id: int | None = None

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Text decoded so far, kept only when stop strings must be checked.
    output_text: str = ""
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the sequence length."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.monotonic()


class RequestRejected(ValueError):
    """The request can never run on this engine (too long, ...); the message names the limit."""


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request: the new tokens since the last output."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_generated_tokens: int
    error: str | None = None
    # Where the request's time went: Unix-second marks the serving processes stamp on it on its way out
    # (``monitor/stages.py`` names them); None from an engine on its own.
    marks: dict[str, float] | None = None

    @property
    def has_first_token(self) -> bool:
        """This output carries the request's first sampled token."""
        return bool(self.new_token_ids) and self.num_generated_tokens == len(self.new_token_ids)

    def marked(self, marks: Mapping[str, float]) -> RequestOutput:
        """A copy with ``marks`` added (they win over marks of the same name already here)."""
        return replace(self, marks={**(self.marks or {}), **marks})


def mark_first_tokens(outs: list[RequestOutput], marks: Mapping[str, float]) -> list[RequestOutput]:
    """``outs`` with ``marks`` added to the outputs that carry their request's first token (the step sampled it)."""
    return [o.marked(marks) if o.has_first_token else o for o in outs]
