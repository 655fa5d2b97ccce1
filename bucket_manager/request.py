"""The controller's own view of a request: what scheduling needs, nothing of the engine's types."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class PriorityClass(StrEnum):
    ONLINE = "online"  # latency SLOs (TTFT, TPOT)
    OFFLINE = "offline"  # throughput


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """One queued request. ``priority``: smaller runs first within its class. ``arrival`` is in seconds on the
    controller's clock; SLOs are in milliseconds (None: no target)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    priority_class: PriorityClass = PriorityClass.ONLINE
    priority: int = 0
    arrival: float = 0.0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.prompt_len, int) or self.prompt_len < 1:
            raise ValueError(f"prompt_len must be an int >= 1, got {self.prompt_len!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.priority_class, PriorityClass):
            raise ValueError(f"priority_class must be a PriorityClass, got {self.priority_class!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        if not math.isfinite(self.arrival):
            raise ValueError(f"arrival must be a finite number of seconds, got {self.arrival!r}")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")

    @property
    def ttft_deadline(self) -> float:
        """When the first token is due, in seconds; a request without a TTFT target is never due."""
        return math.inf if self.ttft_slo_ms is None else self.arrival + self.ttft_slo_ms / 1000.0
