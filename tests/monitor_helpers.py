"""Shared builders for the monitor tests: a settable clock and records with sane defaults."""

from __future__ import annotations

from typing import Any

from monitor.records import RequestRecord, WorkerStats

T0 = 1_700_000_040.0  # a real-looking epoch, aligned to the minute, so slots are easy to reason about


class FakeClock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def worker(worker_id: str = "decode-0", **kw: Any) -> WorkerStats:
    base: dict[str, Any] = {
        "worker_id": worker_id,
        "role": "decode",
        "free_memory_bytes": 8 << 30,
        "kv_blocks_total": 100,
        "kv_blocks_used": 25,
        "kv_blocks_free": 75,
        "queue_len": 3,
        "running": 2,
        "batch_latency_ms": 12.5,
        "runtime_compilations": 0,
        "warmed": True,
        "timestamp": T0,
    }
    base.update(kw)
    return WorkerStats(**base)


def request(request_id: str, arrival: float = T0, **kw: Any) -> RequestRecord:
    base: dict[str, Any] = {
        "request_id": request_id,
        "arrival": arrival,
        "priority_class": "online",
        "prompt_tokens": 100,
        "output_tokens": 11,
        "finish_reason": "length",
        "slo_met": True,
        "queue_s": 0.01,
        "prefill_s": 0.05,
        "ttft_s": 0.08,
        "tpot_s": 0.01,
        "e2e_s": 0.2,
        "bucket": (0, 128),
    }
    base.update(kw)
    return RequestRecord(**base)
