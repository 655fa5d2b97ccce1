"""The requests of a benchmark run: a workload's lengths, exact-length prompts, arrival times and priority
classes (:mod:`bench.workloads`), all reproducible from one seed."""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass
from typing import Any

PRIORITY_CLASSES = ("online", "offline")


@dataclass
class BenchRequest:
    """One request to send. ``send_at`` is seconds after the benchmark starts."""

    prompt: str | list[int]
    input_len: int
    output_len: int
    send_at: float = 0.0
    priority: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    request_id: str = ""


def draw_seed(seed: int, rate: float, draw: str = "load", same_every_rate: bool = False) -> int:
    """The seed of one rate's requests (``draw``: "load", or "probe-N" for a run of the unloaded probe): each rate
    of a sweep sends prompts of its own, from the same distribution. With one set of prompts at every rate, a server that
    caches prefixes (vLLM does by default) would serve every rate after the first from its cache.

    ``same_every_rate``: one seed for every rate instead, so each rate sends the same requests (prompts, classes,
    and the same arrival gaps scaled to the rate): for servers that cache no prefixes, a curve that moves with the
    rate alone rather than with each rate's draw too."""
    return zlib.crc32(f"{seed}:{0.0 if same_every_rate else rate:g}:{draw}".encode())


def parse_priority_mix(spec: str | None) -> float | None:
    """``"online:offline"`` weights (e.g. ``3:1``) -> the share of online requests; ``None`` -> None."""
    if spec is None:
        return None
    parts = spec.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        on, off = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"--priority-mix must be ONLINE:OFFLINE weights such as 3:1, got {spec!r}") from None
    if on < 0 or off < 0 or on + off <= 0 or not math.isfinite(on + off):
        raise ValueError(f"--priority-mix weights must be >= 0 and not both 0, got {spec!r}")
    return on / (on + off)


def assign_priorities(n: int, online_share: float | None, seed: int) -> list[str | None]:
    """Each request's class, drawn with the given share of ``online``; reproducible from ``seed``."""
    if online_share is None:
        return [None] * n
    rng = random.Random(f"priority:{seed}")
    return ["online" if rng.random() < online_share else "offline" for _ in range(n)]


def make_requests(
    workload: str,
    num_prompts: int,
    request_rate: float,
    tokenizer: Any,
    *,
    seed: int = 0,
    burstiness: float = 1.0,
    max_model_len: int = 4096,
    max_output_len: int = 1024,
    random_input_len: int = 256,
    random_output_len: int = 64,
    random_range_ratio: float = 0.9,
    online_share: float | None = None,
    alpaca_texts: list[str] | None = None,
    prompt_format: str = "text",
) -> list[BenchRequest]:
    """The requests of a workload: lengths, exact-length prompts, arrival times and classes, all seeded."""
    from bench.workloads import build_prompts, sample_arrivals, sample_lengths

    if prompt_format not in ("text", "token-ids"):
        raise ValueError(f"prompt_format must be 'text' or 'token-ids', got {prompt_format!r}")
    lengths = sample_lengths(
        workload,
        num_prompts,
        seed,
        max_model_len=max_model_len,
        max_output_len=max_output_len,
        random_input_len=random_input_len,
        random_output_len=random_output_len,
        random_range_ratio=random_range_ratio,
    )
    prompts = build_prompts(workload, lengths, tokenizer, seed, alpaca_texts)
    arrivals = sample_arrivals(num_prompts, request_rate, seed, burstiness)
    classes = assign_priorities(num_prompts, online_share, seed)
    return [
        BenchRequest(
            prompt=p.text if prompt_format == "text" else list(p.token_ids),
            input_len=p.input_len,
            output_len=p.output_len,
            send_at=t,
            priority=c,
            request_id=f"bench-{i}",
        )
        for i, (p, t, c) in enumerate(zip(prompts, arrivals, classes, strict=True))
    ]
