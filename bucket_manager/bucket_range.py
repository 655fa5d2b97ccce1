"""One dimension of the shape-bucket grid: the values a dimension is warmed at, from ``(min, step, max, limit)``.

Two strategies:

* **exponential** -- ``limit`` points ``min * (max / min) ** (i / (limit - 1))``, each rounded up to a multiple
  of ``step``; a point that rounds onto a value already taken is replaced by the unused multiple of ``step``
  in ``[min, max]`` nearest to the unrounded point, and generation stops when no candidate is left (the
  rounded-up ``max`` is then added, so it is always present). Small values get dense buckets (little padding
  where most requests are) and large ones sparse buckets.
* **linear** -- from ``min``, double while below ``step`` (a ramp-up that keeps padding low for tiny batches),
  then every multiple of ``step`` up to ``max``.

A minimum of zero (context blocks: "no prefix") is kept as a value of its own and the rest of the range starts
at ``step``, since neither doubling nor a geometric series can leave zero.

In both strategies the largest value is at least ``max`` (rounded up to ``step`` when ``max`` is not a multiple),
so every value in ``[0, max]`` has a bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STRATEGIES = ("exponential", "linear")


@dataclass(frozen=True)
class BucketRange:
    """``(min, step, max, limit)`` of one dimension; ``name`` is used in error messages (e.g. ``prompt_seq``)."""

    min: int
    step: int
    max: int
    limit: int
    name: str = "range"

    def __post_init__(self) -> None:
        for field in ("min", "step", "max", "limit"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{self.name}.{field} must be an int, got {value!r}")
        if self.min < 0:
            raise ValueError(f"{self.name}.min must be >= 0, got {self.min}")
        if self.step <= 0:
            raise ValueError(f"{self.name}.step must be > 0, got {self.step}")
        if self.max <= 0:
            raise ValueError(f"{self.name}.max must be > 0, got {self.max}")
        if self.min > self.max:
            raise ValueError(f"{self.name}.min ({self.min}) must be <= {self.name}.max ({self.max})")
        if self.limit < 1:
            raise ValueError(f"{self.name}.limit must be >= 1, got {self.limit}")

    def values(self, strategy: str) -> list[int]:
        if strategy == "exponential":
            return exponential_values(self.min, self.step, self.max, self.limit)
        if strategy == "linear":
            return linear_values(self.min, self.step, self.max)
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def _round_up(value: float, step: int) -> int:
    return math.ceil(value / step) * step


def exponential_values(vmin: int, step: int, vmax: int, limit: int) -> list[int]:
    if vmin == 0:
        if limit == 1:
            return [0]
        return [0, *exponential_values(min(step, vmax), step, vmax, limit - 1)]
    if limit == 1:
        return [_round_up(vmax, step)]
    # Candidates for replacing a duplicate: the linear grid inside [min, max]; the rounded-up top value may
    # lie above max and is produced by the series itself.
    candidates = set(range(_round_up(vmin, step), vmax + 1, step))
    taken: set[int] = set()
    for i in range(limit):
        point = vmin * (vmax / vmin) ** (i / (limit - 1))
        value = _round_up(point, step)
        if value in taken:
            free = candidates - taken
            if not free:
                break
            # Nearest to the unrounded point; on a tie the larger one, since rounding goes up.
            value = min(free, key=lambda c: (abs(c - point), -c))
        taken.add(value)
    # Stopping early (no unused candidate left) must not lose the top of the range.
    taken.add(max(max(taken), _round_up(vmax, step)))
    return sorted(taken)


def linear_values(vmin: int, step: int, vmax: int) -> list[int]:
    if vmin == 0:
        return [0, *linear_values(min(step, vmax), step, vmax)]
    values: list[int] = []
    ramp = vmin
    while ramp < step and ramp <= vmax:
        values.append(ramp)
        ramp *= 2
    first_stable = max(step, _round_up(vmin, step))
    values.extend(range(first_stable, vmax + 1, step))
    if not values or values[-1] < vmax:
        # max below step (only the ramp ran) keeps max itself; otherwise round it up like the exponential series.
        values.append(vmax if vmax < step else _round_up(vmax, step))
    return sorted(set(values))
