"""A fixed-size, mergeable percentile sketch for latencies.

Values (milliseconds) go into logarithmic bins of ratio GAMMA, as in DDSketch: any
quantile read back is within RELATIVE_ACCURACY (2%) of a value of the right rank. The
range is clamped to [MIN_MS, MAX_MS], so a sketch never has more than MAX_BINS bins
whatever the traffic. Bins are plain integer counters, which is what makes the sketch
work in Redis: recording is an HINCRBY on one field, and merging slots or replicas is
adding counters, so concurrent writers never need a lock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

RELATIVE_ACCURACY = 0.02
GAMMA = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)
_LOG_GAMMA = math.log(GAMMA)
MIN_MS = 0.01
MAX_MS = 1e7
MIN_INDEX = math.ceil(math.log(MIN_MS) / _LOG_GAMMA)
MAX_INDEX = math.ceil(math.log(MAX_MS) / _LOG_GAMMA)
MAX_BINS = MAX_INDEX - MIN_INDEX + 1


def bin_index(value_ms: float) -> int:
    """The bin holding value_ms; values outside the range land in the edge bins."""
    if value_ms <= MIN_MS:
        return MIN_INDEX
    if value_ms >= MAX_MS:
        return MAX_INDEX
    return math.ceil(math.log(value_ms) / _LOG_GAMMA)


def bin_value(index: int) -> float:
    """The representative of bin i = (gamma^(i-1), gamma^i]: the point of least relative error."""
    return 2 * GAMMA**index / (GAMMA + 1)


def quantile(bins: Mapping[int, float], q: float) -> float | None:
    """The q-quantile (0..1) of a sketch given as {bin index: count}; None when empty."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    total = sum(c for c in bins.values() if c > 0)
    if total <= 0:
        return None
    # Lower-rank definition: the smallest value with at least q of the mass at or below it.
    rank = q * (total - 1)
    seen = 0.0
    for index in sorted(bins):
        count = bins[index]
        if count <= 0:
            continue
        seen += count
        if seen > rank:
            return bin_value(index)
    return bin_value(max(bins))


def merge(into: dict[int, float], other: Mapping[int, float]) -> dict[int, float]:
    for index, count in other.items():
        into[index] = into.get(index, 0) + count
    return into
