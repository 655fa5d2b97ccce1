"""The prefill workers' pace: seconds of forward pass per prompt token, token-weighted over recent batches."""

from __future__ import annotations

import math

import pytest

from bucket_manager.prefill_pace import PrefillPace


def test_the_pace_is_token_weighted_and_ignores_nonsense() -> None:
    pace = PrefillPace(alpha=0.5)
    assert pace.seconds_per_token == 0.0  # nothing reported: only past deadlines count as late
    pace.observe(1000, 1.0)
    assert pace.seconds_per_token == pytest.approx(0.001)
    # A short batch with a large fixed overhead moves the pace far less than its own per-token time (4 ms).
    pace.observe(10, 0.04)
    assert pace.seconds_per_token == pytest.approx((0.5 * 0.5 + 0.5 * 0.04) / (0.5 * 500 + 0.5 * 10))
    before = pace.seconds_per_token
    for tokens, seconds in ((0, 1.0), (100, 0.0), (100, -1.0), (100, math.nan), (100, math.inf)):
        pace.observe(tokens, seconds)
    assert pace.seconds_per_token == before
    for alpha in (0, 1.5, "x"):
        with pytest.raises(ValueError, match="alpha"):
            PrefillPace(alpha=alpha)
