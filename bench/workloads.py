"""Synthetic workloads: request lengths and arrival times with the statistics of the shared data README.

Every function is pure and seeded: the same arguments give the same numbers. Lengths are in tokens.

* ``alpaca`` -- instruction prompts: input log-normal with mean ~83 and a long right tail (about 1-2% above
  256); output log-normal with mean ~150 (inside the 60-300 range reported), capped by ``max_output_len``.
* ``longbench`` -- long documents: input log-normal with median 41,417, truncated to what the model accepts;
  short outputs (summaries, median 64).
* ``mixed`` -- mostly short (alpaca-like, below 256) with a long tail of long prompts above 1024 (a share
  ``long_fraction``); long prompts are ``1025 +`` a log-normal excess, truncated to the model. When the model
  cannot take more than 1024 input tokens the long ones are simply the longest it takes.
* ``random`` -- input uniform in ``input_len * (1 +- range_ratio)``, output fixed.

Each request satisfies ``input_len >= 1``, ``output_len >= 1`` and ``input_len + output_len <= max_model_len``.
"""

from __future__ import annotations

import math
import random

WORKLOADS = ("alpaca", "longbench", "mixed", "random")

ALPACA_INPUT_MEAN = 83.0
ALPACA_INPUT_SIGMA = 0.6
ALPACA_OUTPUT_MEAN = 150.0
ALPACA_OUTPUT_SIGMA = 0.8
LONGBENCH_INPUT_MEDIAN = 41_417.0
LONGBENCH_INPUT_SIGMA = 1.0
LONGBENCH_OUTPUT_MEDIAN = 64.0
LONGBENCH_OUTPUT_SIGMA = 0.5
SHORT_LIMIT = 256  # "short" prompts are below this
LONG_FLOOR = 1024  # "long" prompts are above this
LONG_EXCESS_MEDIAN = 400.0
LONG_EXCESS_SIGMA = 0.9


def _lognormal_with_mean(rng: random.Random, mean: float, sigma: float) -> float:
    # A log-normal's mean is exp(mu + sigma^2 / 2): solve for mu so the stated mean holds.
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2.0, sigma)


def _fit(input_len: float, output_len: float, max_model_len: int, max_output_len: int) -> tuple[int, int]:
    """Round and truncate so the pair fits the model, the output first (as a server caps max_tokens)."""
    out = max(1, min(round(output_len), max_output_len, max_model_len - 1))
    inp = max(1, min(round(input_len), max_model_len - out))
    return inp, out


def _alpaca(rng: random.Random, max_model_len: int, max_output_len: int, short_only: bool) -> tuple[int, int]:
    inp = _lognormal_with_mean(rng, ALPACA_INPUT_MEAN, ALPACA_INPUT_SIGMA)
    if short_only:
        inp = min(inp, SHORT_LIMIT - 1)
    out = _lognormal_with_mean(rng, ALPACA_OUTPUT_MEAN, ALPACA_OUTPUT_SIGMA)
    return _fit(inp, out, max_model_len, max_output_len)


def _summary_len(rng: random.Random) -> float:
    return rng.lognormvariate(math.log(LONGBENCH_OUTPUT_MEDIAN), LONGBENCH_OUTPUT_SIGMA)


def _longbench(rng: random.Random, max_model_len: int, max_output_len: int) -> tuple[int, int]:
    inp = rng.lognormvariate(math.log(LONGBENCH_INPUT_MEDIAN), LONGBENCH_INPUT_SIGMA)
    return _fit(inp, _summary_len(rng), max_model_len, max_output_len)


def _long(rng: random.Random, max_model_len: int, max_output_len: int) -> tuple[int, int]:
    inp = LONG_FLOOR + 1 + rng.lognormvariate(math.log(LONG_EXCESS_MEDIAN), LONG_EXCESS_SIGMA)
    return _fit(inp, _summary_len(rng), max_model_len, max_output_len)


def sample_lengths(
    workload: str,
    n: int,
    seed: int,
    max_model_len: int = 4096,
    max_output_len: int = 1024,
    long_fraction: float = 0.2,
    random_input_len: int = 256,
    random_output_len: int = 64,
    random_range_ratio: float = 0.9,
) -> list[tuple[int, int]]:
    """``n`` pairs ``(input_len, output_len)`` of a workload, reproducible from ``seed``."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if max_output_len < 1:
        raise ValueError(f"max_output_len must be >= 1, got {max_output_len}")
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    if not 0.0 <= random_range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {random_range_ratio}")
    if random_input_len < 1 or random_output_len < 1:
        raise ValueError("random_input_len and random_output_len must be >= 1")
    rng = random.Random(seed)
    if workload == "alpaca":
        return [_alpaca(rng, max_model_len, max_output_len, short_only=False) for _ in range(n)]
    if workload == "longbench":
        return [_longbench(rng, max_model_len, max_output_len) for _ in range(n)]
    if workload == "mixed":
        return [
            _long(rng, max_model_len, max_output_len)
            if rng.random() < long_fraction
            else _alpaca(rng, max_model_len, max_output_len, short_only=True)
            for _ in range(n)
        ]
    low = max(1, round(random_input_len * (1 - random_range_ratio)))
    high = max(low, round(random_input_len * (1 + random_range_ratio)))
    return [_fit(rng.randint(low, high), random_output_len, max_model_len, max_output_len) for _ in range(n)]


def sample_arrivals(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Arrival times in seconds from 0: gamma-distributed gaps with mean ``1 / rate``; ``burstiness`` 1 is
    Poisson, below 1 burstier, above 1 more regular. ``rate`` infinite: everything arrives at 0."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    t = 0.0
    times = []
    for _ in range(n):
        t += rng.gammavariate(burstiness, scale)
        times.append(t)
    return times
