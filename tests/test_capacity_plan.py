"""Sizing a cluster on the simulator (``simulate --plan``): projections for Gaudi 2/3 and H100/H200, tensor
parallelism for a model one card cannot hold, and the fewest workers (and nodes) that hold an SLO goal."""

from __future__ import annotations

import json

import pytest

from bench.simulator.capacity import plan_cluster, recommend_split
from bench.simulator.cost_model import ACCELERATORS, project, tensor_parallel
from bench.simulator.sim import SimConfig
from gateway.cli import main


@pytest.mark.parametrize(("hardware", "tp70"), [("gaudi2", 4), ("gaudi3", 2), ("h100", 4), ("h200", 2)])
def test_cards_per_worker_hold_the_weights(hardware: str, tp70: int) -> None:
    assert tensor_parallel(hardware, "llama3-8b") == 1
    assert tensor_parallel(hardware, "llama3-70b") == tp70
    # 70B's bf16 weights (141 GB) within 60% of the worker's memory, with room left for KV.
    acc = ACCELERATORS[hardware]
    assert 70.6e9 * 2 / tp70 <= 0.6 * acc.memory_bytes
    assert project(hardware, "llama3-70b").num_blocks > 0


def test_tensor_parallel_cost() -> None:
    one, two = project("h100", "llama3-70b", tp=4), project("h100", "llama3-70b", tp=8)
    # Twice the cards: less than half the compute time per token is impossible (the all-reduces grow).
    assert two.prefill_per_token_s < one.prefill_per_token_s
    assert two.prefill_per_token_s > one.prefill_per_token_s / 2
    assert two.num_blocks > one.num_blocks
    assert one.name == "h100-llama3-70b-tp4" and "4 card(s) per worker" in one.source
    with pytest.raises(ValueError, match="leaves no KV memory"):
        project("h100", "llama3-70b", tp=1)
    with pytest.raises(ValueError, match="tp must be"):
        project("h100", "llama3-8b", tp=3)


def test_plan_is_the_fewest_workers_that_hold_the_goal() -> None:
    config = SimConfig(project("h100", "llama3-8b"))
    plan = plan_cluster(config, 1, 8, "mixed", 60.0, 600, goal=0.9, max_workers=16)
    assert plan["reached"] and plan["attainment"] >= 0.9
    assert plan["prefill_workers"] + plan["decode_workers"] == plan["workers"] == plan["cards"]
    # Prefill and decode each on nodes of their own.
    assert plan["nodes"] == -(-plan["prefill_workers"] // 8) + -(-plan["decode_workers"] // 8)
    if plan["workers"] > 2:
        fewer = recommend_split(config, plan["workers"] - 1, "mixed", 60.0, 600)
        assert fewer["recommended_attainment"] < 0.9, fewer
    # Out of reach within the bound: said, with the best found.
    far = plan_cluster(config, 1, 8, "mixed", 5000.0, 300, goal=0.99, max_workers=4)
    assert far["reached"] is False and far["best"]["cards"] == 4


def test_plan_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--hardware", "h200", "--projection-model", "llama3-70b", "--target-rate", "5"]
    assert main([*argv, "--plan", "--num-prompts", "200"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    plan = json.loads(lines[-1])["plan"]
    assert plan["reached"] and plan["tp"] == 2 and plan["cards"] == 2 * plan["workers"]
    assert any("(projection)" in line for line in lines)
    assert main(["simulate", "--plan", "--target-rate", "5"]) == 2
    assert "--plan needs --hardware and --target-rate" in capsys.readouterr().err
