"""How fast the prefill workers get through prompt tokens, from the forward times they report.

The controller orders online requests by what they can still meet: a request whose prompt, prefilled now at this
pace, would give its first token after its TTFT deadline goes after the ones that can still make theirs
(``PriorityPolicy.late_last``). The pace is seconds of forward pass per prompt token, token-weighted over recent
batches (an exponential average of both the seconds and the tokens, so large batches, whose per-token time is
nearest the real cost of a long prompt, weigh most and a short batch's fixed overhead does not inflate it).
Until a batch has been reported the pace is 0: only requests already past their deadline count as late.

Pure arithmetic: no clock, no Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PrefillPace:
    # Weight of the newest batch in both averages.
    alpha: float = 0.25
    _seconds: float = 0.0
    _tokens: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha, int | float) and 0.0 < self.alpha <= 1.0):
            raise ValueError(f"PrefillPace.alpha must be in (0, 1], got {self.alpha!r}")

    def observe(self, tokens: int, seconds: float) -> None:
        """A prefill batch of ``tokens`` prompt tokens took ``seconds`` of forward pass. Nonsense is ignored."""
        if tokens < 1 or not (math.isfinite(seconds) and seconds > 0.0):
            return
        a = self.alpha
        self._seconds = (1.0 - a) * self._seconds + a * seconds
        self._tokens = (1.0 - a) * self._tokens + a * tokens

    @property
    def seconds_per_token(self) -> float:
        return self._seconds / self._tokens if self._tokens else 0.0
