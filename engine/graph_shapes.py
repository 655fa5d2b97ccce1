"""Sizes that graphs are captured at: a pure policy over ints, shared by the runner and the devices."""

from __future__ import annotations


def graph_ladder(limit: int, smallest: int = 1) -> list[int]:
    """Powers of two from ``smallest`` up to ``limit``, and ``limit`` itself: the padded sizes that decode graphs
    are captured at (a step pads up to the next one, wasting less than half)."""
    sizes = []
    n = smallest
    while n < limit:
        sizes.append(n)
        n *= 2
    return [*sizes, limit]
