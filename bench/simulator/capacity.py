"""Capacity planning on the simulator: the attainment curve of a cluster, and the prefill:decode split of a fixed
number of cards that best serves a target rate within the SLO."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bench.simulator.sim import SimConfig, max_rate_at, simulate


def curve(
    config: SimConfig, workload: str, rates: list[float], num_requests: int, seed: int = 0, **kw: Any
) -> dict[str, Any]:
    rows = [simulate(config, workload, r, num_requests, seed, **kw).summary() for r in rates]
    return {
        "rows": rows,
        "max_rate_at_80pct": max_rate_at(rows, 0.8),
        "max_rate_at_90pct": max_rate_at(rows, 0.9),
    }


def recommend_split(
    config: SimConfig,
    cards: int,
    workload: str,
    target_rate: float,
    num_requests: int,
    seed: int = 0,
    **kw: Any,
) -> dict[str, Any]:
    """Try every ``p`` prefill + ``cards - p`` decode split at ``target_rate``; recommend the one with the highest
    SLO attainment (then goodput, then fewer prefill cards: decode memory is what later growth needs)."""
    if cards < 2:
        raise ValueError(f"a disaggregated split needs at least 2 cards, got {cards}")
    rows = []
    for p in range(1, cards):
        split = replace(config, mode="disaggregated", prefill_workers=p, decode_workers=cards - p)
        s = simulate(split, workload, target_rate, num_requests, seed, **kw).summary()
        rows.append(
            {
                "prefill_workers": p,
                "decode_workers": cards - p,
                "slo_attainment": s["slo_attainment"],
                "goodput_rps": s["goodput_rps"],
                "ttft_p99_ms": s["ttft_p99_ms"],
                "tpot_p99_ms": s["tpot_p99_ms"],
            }
        )
    best = max(
        rows, key=lambda r: (r["slo_attainment"] or 0.0, r["goodput_rps"] or 0.0, -r["prefill_workers"])
    )
    return {
        "cards": cards,
        "target_rate": target_rate,
        "splits": rows,
        "recommended": f"{best['prefill_workers']}:{best['decode_workers']}",
        "recommended_attainment": best["slo_attainment"],
    }


def _nodes(workers: int, tp: int, cards_per_node: int) -> int:
    return -(-workers * tp // cards_per_node)


def plan_cluster(
    config: SimConfig,
    tp: int,
    cards_per_node: int,
    workload: str,
    target_rate: float,
    num_requests: int,
    goal: float = 0.9,
    max_workers: int = 64,
    seed: int = 0,
    **kw: Any,
) -> dict[str, Any]:
    """The fewest workers (of ``tp`` cards each) whose best prefill:decode split holds ``goal`` SLO attainment at
    ``target_rate``, and the nodes they take: prefill and decode on nodes of their own (the node groups of a
    KubeRay deployment), ``cards_per_node`` cards each.

    Attainment grows with the worker count, so the count is found by doubling and then bisecting, each step
    trying every split of that count.
    """
    if not 0 < goal <= 1:
        raise ValueError(f"goal must be in (0, 1], got {goal}")
    tried: dict[int, dict[str, Any]] = {}

    def best(workers: int) -> dict[str, Any]:
        if workers not in tried:
            tried[workers] = recommend_split(config, workers, workload, target_rate, num_requests, seed, **kw)
        return tried[workers]

    def holds(workers: int) -> bool:
        return (best(workers)["recommended_attainment"] or 0.0) >= goal

    lo, hi = 1, 2  # lo: known too few (a split needs 2)
    while not holds(hi):
        lo = hi
        if hi >= max_workers:
            return {"reached": False, "goal": goal, "max_workers": max_workers, "best": best(hi)}
        hi = min(2 * hi, max_workers)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid
    split = best(hi)
    p, d = (int(x) for x in split["recommended"].split(":"))
    return {
        "reached": True,
        "goal": goal,
        "target_rate": target_rate,
        "tp": tp,
        "workers": hi,
        "prefill_workers": p,
        "decode_workers": d,
        "cards": hi * tp,
        "nodes": _nodes(p, tp, cards_per_node) + _nodes(d, tp, cards_per_node),
        "attainment": split["recommended_attainment"],
        "split": split,
    }
