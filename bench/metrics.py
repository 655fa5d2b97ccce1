"""What a benchmark run measured, shared by the load generator (:mod:`bench.client`), the sweep and the
simulator: per-request outcomes, the run's summary, and the rate at a target SLO attainment.

Definitions (the same as common serving benchmarks):

* TTFT: from the moment the request is due to the first streamed token. The clock starts before the
  client waits for a free connection, as a user's would; that wait is reported as ``pool_wait``.
* TPOT: ``(e2e - TTFT) / (output_tokens - 1)``, the mean time per token after the first; a request of
  one output token has no TPOT and meets any TPOT bound.
* ITL: the gaps between consecutive streamed chunks carrying tokens.
* Output tokens: the server's ``usage.completion_tokens`` when it reports usage, else the number of
  chunks carrying tokens.
* A request meets its SLO when it succeeded, TTFT <= the TTFT bound and TPOT <= the TPOT bound. SLO
  attainment is over all requests (a failure counts as a miss); goodput is SLO-meeting requests per
  second of the run.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# How many distinct failure messages the summary lists.
MAX_ERRORS_SHOWN = 5


@dataclass
class RequestOutcome:
    """What one request measured. Times are seconds; ``start_s`` is relative to the benchmark start."""

    request_id: str
    priority: str | None
    input_len: int
    expected_output_len: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    start_s: float = 0.0
    pool_wait_s: float = 0.0
    success: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    token_chunks: int = 0
    usage_reported: bool = False
    server_prompt_tokens: int | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def meets_slo(self) -> bool:
        if not self.success or self.ttft_s is None:
            return False
        tpot = self.tpot_s
        return self.ttft_s * 1e3 <= self.slo_ttft_ms and (tpot is None or tpot * 1e3 <= self.slo_tpot_ms)

    def to_dict(self) -> dict[str, Any]:
        tpot = self.tpot_s
        return {
            "request_id": self.request_id,
            "priority": self.priority,
            "input_len": self.input_len,
            "expected_output_len": self.expected_output_len,
            "success": self.success,
            "error": self.error,
            "start_s": round(self.start_s, 6),
            "ttft_ms": _ms(self.ttft_s),
            "tpot_ms": _ms(tpot),
            "e2e_ms": _ms(self.e2e_s),
            "output_tokens": self.output_tokens,
            "server_prompt_tokens": self.server_prompt_tokens,
            "meets_slo": self.meets_slo(),
        }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1e3, 3)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks; ``None`` when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(prefix: str, seconds: list[float]) -> dict[str, float | None]:
    ms = [s * 1e3 for s in seconds]
    out: dict[str, float | None] = {f"{prefix}_mean_ms": sum(ms) / len(ms) if ms else None}
    for q in (50, 90, 99):
        out[f"{prefix}_p{q}_ms"] = percentile(ms, q)
    return {k: None if v is None else round(v, 3) for k, v in out.items()}


@dataclass
class BenchResult:
    outcomes: list[RequestOutcome]
    duration_s: float
    request_rate: float | None = None
    burstiness: float | None = None
    # CPU this client used while sending (a client on the server's machine competes for its cores)
    client_cpu_s: float | None = None

    def summary(self) -> dict[str, Any]:
        """Aggregates over the run: throughput, SLO attainment, goodput, latency percentiles, failures."""
        done = [o for o in self.outcomes if o.success]
        failed = [o for o in self.outcomes if not o.success]
        met = [o for o in self.outcomes if o.meets_slo()]
        dur = self.duration_s if self.duration_s > 0 else float("nan")
        n = len(self.outcomes)
        out_tokens = sum(o.output_tokens for o in done)
        rate = self.request_rate
        summary: dict[str, Any] = {
            "request_rate": None if rate is None else ("inf" if math.isinf(rate) else rate),
            "burstiness": self.burstiness,
            "num_requests": n,
            "completed": len(done),
            "failed": len(failed),
            "duration_s": round(self.duration_s, 4),
            "request_throughput_rps": _round(len(done) / dur),
            "output_tok_per_s": _round(out_tokens / dur),
            "total_input_tokens": sum(o.input_len for o in done),
            "total_output_tokens": out_tokens,
            "slo_attainment": _round(len(met) / n) if n else None,
            "goodput_rps": _round(len(met) / dur),
            "client_cpu_s": None if self.client_cpu_s is None else round(self.client_cpu_s, 3),
        }
        slos = {(o.slo_ttft_ms, o.slo_tpot_ms) for o in self.outcomes}
        if len(slos) == 1:
            summary["slo_ttft_ms"], summary["slo_tpot_ms"] = next(iter(slos))
        summary |= _stats("ttft", [o.ttft_s for o in done if o.ttft_s is not None])
        summary |= _stats("tpot", [t for o in done if (t := o.tpot_s) is not None])
        summary |= _stats("itl", [x for o in done for x in o.itl_s])
        summary |= _stats("e2e", [o.e2e_s for o in done if o.e2e_s is not None])
        # Time spent waiting for a free connection: large values mean the client, not the server, queued.
        wait = _stats("pool_wait", [o.pool_wait_s for o in self.outcomes])
        summary |= {k: v for k, v in wait.items() if k.endswith(("_mean_ms", "_p99_ms"))}
        summary["usage_reported"] = sum(o.usage_reported for o in done)
        summary["prompt_len_mismatch"] = sum(
            o.server_prompt_tokens is not None and o.server_prompt_tokens != o.input_len for o in done
        )
        summary["short_outputs"] = sum(o.output_tokens < o.expected_output_len for o in done)
        classes = sorted({o.priority for o in self.outcomes if o.priority is not None})
        if classes:
            per_class = {}
            for c in classes:
                mine = [o for o in self.outcomes if o.priority == c]
                c_met = sum(o.meets_slo() for o in mine)
                c_done = [o for o in mine if o.success]
                per_class[c] = {
                    "requests": len(mine),
                    "completed": len(c_done),
                    "slo_attainment": _round(c_met / len(mine)),
                    "goodput_rps": _round(c_met / dur),
                    **_stats("ttft", [o.ttft_s for o in c_done if o.ttft_s is not None]),
                    **_stats("tpot", [t for o in c_done if (t := o.tpot_s) is not None]),
                }
                summary[f"slo_attainment_{c}"] = per_class[c]["slo_attainment"]
            summary["classes"] = per_class
        errors = Counter(o.error or "unknown error" for o in failed)
        summary["errors"] = [{"error": e, "count": c} for e, c in errors.most_common(MAX_ERRORS_SHOWN)]
        return summary


def _round(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


# --------------------------------------------------------------------------- rate at a target attainment


@dataclass(frozen=True)
class RateAtTarget:
    """The highest rate meeting the target attainment.

    ``kind``: ``interpolated`` (between the last rate meeting it and the next measured one), ``at_least`` (every
    measured rate up to the highest met it: ``rate`` is a lower bound), ``below`` (no measured rate met it: the
    rate is below ``rate``, the lowest measured), ``none`` (nothing measured).
    """

    rate: float | None
    kind: str

    def text(self) -> str:
        if self.rate is None:
            return "-"
        prefix = {"at_least": ">= ", "below": "< "}.get(self.kind, "")
        return f"{prefix}{self.rate:.3g}"


def rate_at_target(points: Sequence[tuple[float, float | None]], target: float = 0.8) -> RateAtTarget:
    """``points``: (rate, attainment); attainment None = not measured (skipped), ignored.

    The highest measured rate with attainment >= target is found; when a higher rate was measured, the rate is
    interpolated linearly between that one and the next measured rate, whose attainment is below target.
    """
    measured = sorted((r, a) for r, a in points if a is not None)
    if not measured:
        return RateAtTarget(None, "none")
    ok = [i for i, (_, a) in enumerate(measured) if a >= target]
    if not ok:
        return RateAtTarget(measured[0][0], "below")
    i = ok[-1]
    r0, a0 = measured[i]
    if i == len(measured) - 1:
        return RateAtTarget(r0, "at_least")
    r1, a1 = measured[i + 1]
    # a1 < target <= a0 here, so the denominator is positive.
    return RateAtTarget(r0 + (a0 - target) / (a0 - a1) * (r1 - r0), "interpolated")


@dataclass(frozen=True)
class Ratio:
    value: float | None
    relation: str  # "=", ">=", "<=", ">", or "?" when the bounds do not decide it

    def text(self) -> str:
        if self.value is None:
            return "-"
        return f"{self.value:.2f}x" if self.relation == "=" else f"{self.relation} {self.value:.2f}x"


def ratio(a: RateAtTarget, b: RateAtTarget) -> Ratio:
    """a / b, with what the bounds allow: a lower bound over an exact rate is a lower bound, and so on."""
    if a.rate is None or b.rate is None or a.kind == "none" or b.kind == "none":
        return Ratio(None, "?")
    if b.kind == "below":
        # b serves less than its lowest measured rate: the ratio is above a / that rate, if a met it at all.
        if a.kind == "below":
            return Ratio(None, "?")
        return Ratio(a.rate / b.rate, ">")
    if a.kind == "below":
        return Ratio(a.rate / b.rate, "<")
    if b.rate <= 0:
        return Ratio(None, "?")
    value = a.rate / b.rate
    exact_a, exact_b = a.kind == "interpolated", b.kind == "interpolated"
    if exact_a and exact_b:
        return Ratio(value, "=")
    if not exact_a and exact_b:
        return Ratio(value, ">=")
    if exact_a and not exact_b:
        return Ratio(value, "<=")
    return Ratio(value, "?")
