"""How many prompt tokens a step may carry without breaking the time per output token of the requests decoding
in it: the guard of chunked prefill mixed into decode steps.

A step of flat tokens runs the decodes and the prompt chunks together, so every prompt token in it delays the
next token of every request decoding there. Without a guard one step may take a whole long prompt (the token
budget is 4096): on a 2-core host a 2000-token prompt is a 2.4 s step on one core, thirty times the 81.7 ms a
token of an online request may take. A fixed smaller budget spreads the same work over more steps and changes
nothing for a request's average TPOT (a colocated sweep with a 512-token budget measured the same as with
4096); what smaller steps do bring is earlier first tokens within a burst, which is why a colocated worker on a
CPU defaults to 512 (``engine.config.COLOCATED_CPU_STEP_TOKENS``).

The guard is in time: the SLO is on each request's average time per output token, ``(t_last - t_first) / (n -
1)``, so a request that has been decoding faster than its SLO has saved time that one longer step may spend.
Before each step, for every decoding request with a TPOT SLO, the step may take at most
``margin * slo * (tokens_after_first + 1) - (now - first_token_time)``: the request's average stays within
``margin`` of its SLO after this step's token. The smallest allowance over the decoding requests, less the time
the decodes alone take, divided by the time one prompt token takes, caps the step's prompt tokens; at least
``floor`` tokens still go in, so prompts always progress. Requests without an SLO (offline engine use) set no cap.

Off by default (``--tpot-guard on``): it trades the prompts' TTFT for the decodes' TPOT. On a bursty two-class
sweep (README, "TPOT guard") it held the colocated system's online TPOT p90 at 73-74 ms (105-127 ms without),
while the offline prompts it held back got their first tokens seconds later, and attainment came out level. Under
vLLM's client (every request at a 50 ms TPOT SLO) it cut the disaggregated cluster's attainment at 5-7 req/s from
1.0 / 1.0 / 0.55 to 0.65 / 0.50 / 0.40: lent prompts in small chunks take many steps, each streaming every weight.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bucket_manager.prefill_pace import PrefillPace

# Of a request's TPOT SLO the guard plans to use: the rest absorbs the estimates' error and the time a token
# takes from the engine to the client.
MARGIN = 0.9
# Prompt tokens a step takes even when a decoding request has no time left: a prompt never stalls, and a chunk
# this small costs a decode step a few milliseconds on a 2-core host.
FLOOR_TOKENS = 16
# Weight of the newest observation in the running estimates (about the last ten steps count).
_ALPHA = 0.2
# Steps with fewer prompt tokens than this do not update the per-token estimate: the decode part's jitter
# would swamp it.
_MIN_PROMPT_TOKENS = 32


@dataclass(frozen=True)
class DecodeClock:
    """A decoding request as the guard sees it."""

    tpot_slo_s: float
    tokens_after_first: int  # tokens out after its first one
    since_first_s: float  # now - its first token's time


def step_allowance_s(decodes: Iterable[DecodeClock], margin: float = MARGIN) -> float | None:
    """The longest the next step may take so that every decoding request's average time per output token stays
    within ``margin`` of its SLO once this step's token is out; None when no request sets a limit."""
    allowance = None
    for d in decodes:
        a = margin * d.tpot_slo_s * (d.tokens_after_first + 1) - d.since_first_s
        allowance = a if allowance is None else min(allowance, a)
    return allowance


def prompt_token_cap(
    allowance_s: float | None,
    decode_step_s: float | None,
    prompt_s_per_token: float | None,
    floor: int = FLOOR_TOKENS,
) -> int | None:
    """Prompt tokens the next step may carry: what fits in ``allowance_s`` beside the decodes
    (``decode_step_s``; None before a step of decodes alone was timed) at ``prompt_s_per_token``, at least
    ``floor``; None (no cap) when there is no allowance or no per-token estimate yet."""
    if allowance_s is None or prompt_s_per_token is None or prompt_s_per_token <= 0:
        return None
    spare = allowance_s - (decode_step_s or 0.0)
    return max(floor, int(spare / prompt_s_per_token)) if spare > 0 else floor


class StepClock:
    """Running estimates of what a step costs: the decodes alone (steps without prompt tokens) and each prompt
    token on top of them (steps with prompt chunks, less the decode estimate; token-weighted, as the
    controller's prefill pace is)."""

    def __init__(self) -> None:
        self.decode_step_s: float | None = None
        self._prompt = PrefillPace(alpha=_ALPHA)

    @property
    def prompt_s_per_token(self) -> float | None:
        """None until a step with enough prompt tokens was timed."""
        return self._prompt.seconds_per_token or None

    def observe(self, seconds: float, decodes: int, prompt_tokens: int) -> None:
        if prompt_tokens == 0:
            if decodes:
                old = self.decode_step_s
                self.decode_step_s = seconds if old is None else (1 - _ALPHA) * old + _ALPHA * seconds
            return
        if prompt_tokens < _MIN_PROMPT_TOKENS:
            return
        base = self.decode_step_s if decodes and self.decode_step_s is not None else 0.0
        self._prompt.observe(prompt_tokens, seconds - base)
