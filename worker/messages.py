"""Typed messages that carry a request between processes (gateway -> prefill worker -> decode worker).

A :class:`RequestMessage` is frozen and made of plain values, so it pickles cheaply through Ray; each
worker turns it into an engine :class:`~engine.request.Request` at its edge with :meth:`to_request`.
Times are Unix seconds (``time.time()``): monotonic clocks do not agree across processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bucket_manager.request import RequestSummary
from engine.request import PriorityClass, Request, SamplingParams


@dataclass(frozen=True)
class RequestMessage:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    # Which gateway drains this request's outputs: workers keep one output buffer per consumer.
    consumer_id: str
    priority_class: str = PriorityClass.ONLINE.value
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    arrival_unix: float = 0.0
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("RequestMessage.request_id must be non-empty")
        if not self.prompt_token_ids:
            raise ValueError(f"RequestMessage.prompt_token_ids of {self.request_id!r} must be non-empty")
        if not self.consumer_id:
            raise ValueError("RequestMessage.consumer_id must be non-empty")
        if self.priority_class not in (PriorityClass.ONLINE.value, PriorityClass.OFFLINE.value):
            raise ValueError(
                f"RequestMessage.priority_class must be 'online' or 'offline', got {self.priority_class!r}"
            )

    @classmethod
    def from_request(cls, req: Request, consumer_id: str) -> RequestMessage:
        # The engine's arrival_time is monotonic (this process only); carry its wall-clock equivalent.
        arrival = time.time() - (time.monotonic() - req.arrival_time)
        return cls(
            request_id=req.request_id,
            prompt_token_ids=tuple(req.prompt_token_ids),
            sampling=req.sampling,
            consumer_id=consumer_id,
            priority_class=PriorityClass(req.priority_class).value,
            priority=req.priority,
            slo_ttft_ms=req.slo_ttft_ms,
            slo_tpot_ms=req.slo_tpot_ms,
            arrival_unix=arrival,
            eos_token_id=req.eos_token_id,
        )

    def to_request(self) -> Request:
        return Request(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids),
            sampling=self.sampling,
            priority_class=PriorityClass(self.priority_class),
            priority=self.priority,
            slo_ttft_ms=self.slo_ttft_ms,
            slo_tpot_ms=self.slo_tpot_ms,
            arrival_time=time.monotonic() - max(0.0, time.time() - self.arrival_unix),
            eos_token_id=self.eos_token_id,
        )

    def summary(self) -> RequestSummary:
        """What the controller plans with (it never sees the prompt itself)."""
        return RequestSummary(
            request_id=self.request_id,
            prompt_len=self.num_prompt_tokens,
            max_tokens=self.sampling.max_tokens,
            priority_class=PriorityClass(self.priority_class),
            priority=self.priority,
            arrival=self.arrival_unix,
            ttft_slo_ms=self.slo_ttft_ms,
            tpot_slo_ms=self.slo_tpot_ms,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class PrefilledMessage:
    """What a decode worker needs besides the KV blocks: the request and its first sampled token."""

    request: RequestMessage
    first_token: int
    first_logprob: float | None = None

    def to_request(self, block_ids: list[int], num_computed_tokens: int) -> Request:
        req = self.request.to_request()
        req.output_token_ids = [self.first_token]
        if self.first_logprob is not None:
            req.output_logprobs = [self.first_logprob]
        req.block_ids = list(block_ids)
        req.num_computed_tokens = num_computed_tokens
        req.first_token_time = time.monotonic()
        return req
