"""Capacity simulator: determinism, monotonicity in workers and rate, the bucket-manager policies it drives, the
cost-model fits, projections and the command line. Pure Python, no Ray, no model."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

import bench.simulator.sim as sim_module
from bench.simulator.capacity import recommend_split
from bench.simulator.cost_model import CostModel, fit_decode, fit_prefill, nonnegative_lstsq, project
from bench.simulator.sim import SimConfig, Simulator, max_rate_at, simulate
from bucket_manager import batch_plan, memory_budget, request_buckets
from bucket_manager import dispatcher as dispatcher_module
from gateway.cli import main

REPORTS_DIR = Path(__file__).resolve().parents[1] / "bench" / "reports"

# A small CPU-like model: prefill ~0.4 ms/token, decode steps of 10-30 ms. Stated here, not measured, so the
# tests do not move when the committed calibration is refreshed.
COST = CostModel(
    name="test",
    source="synthetic",
    prefill_base_s=0.005,
    prefill_per_seq_s=0.001,
    prefill_per_token_s=4e-4,
    prefill_per_attn_s=1e-8,
    decode_base_s=0.01,
    decode_per_seq_s=5e-4,
    decode_per_block_s=5e-5,
    transfer_latency_s=0.002,
    transfer_gbps=0.7,
    kv_bytes_per_token=16384,
    block_size=16,
    num_blocks=4096,
    max_model_len=2048,
)


def config(**kw) -> SimConfig:
    return SimConfig(
        COST, slo_ttft_ms=kw.pop("slo_ttft_ms", 1000.0), slo_tpot_ms=kw.pop("slo_tpot_ms", 60.0), **kw
    )


def attainment(cfg: SimConfig, rate: float, n: int = 200, seed: int = 0) -> float:
    return simulate(cfg, "mixed", rate, n, seed).summary()["slo_attainment"]


def test_same_seed_same_result_other_seed_differs() -> None:
    a = simulate(config(), "mixed", 3.0, 150, seed=1).summary()
    b = simulate(config(), "mixed", 3.0, 150, seed=1).summary()
    c = simulate(config(), "mixed", 3.0, 150, seed=2).summary()
    assert a == b
    assert a != c


def test_every_request_finishes_with_sane_latencies() -> None:
    result = simulate(config(), "mixed", 4.0, 200, seed=3)
    for r in result.requests:
        assert r.first_token is not None and r.finish is not None
        assert r.arrival < r.first_token <= r.finish
        assert r.generated == r.output_len or r.num_tokens >= COST.max_model_len
    assert result.summary()["completed"] == 200


@pytest.mark.parametrize("rate", [3.0, 6.0, 10.0])
def test_more_workers_never_lower_attainment(rate: float) -> None:
    # Each step adds workers (a decode worker, then pairs). Adding only prefill workers in front of a saturated
    # decode worker may lower attainment (more requests share its slow steps), so that is not claimed.
    sizes = [(1, 1), (1, 2), (2, 2), (3, 3), (4, 4), (8, 8)]
    att = [attainment(config(prefill_workers=p, decode_workers=d), rate) for p, d in sizes]
    for smaller, larger in zip(att, att[1:], strict=False):
        assert larger >= smaller, dict(zip(sizes, att, strict=True))
    # The load is real: one pair of workers misses SLOs that eight pairs meet.
    assert att[0] < att[-1]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_attainment_falls_as_rate_rises(mode: str) -> None:
    rates = [0.5, 1, 2, 4, 8, 16, 32]
    att = [attainment(config(mode=mode), r) for r in rates]
    assert att[0] >= 0.9
    assert att[-1] <= 0.3
    for lo, hi in zip(att, att[1:], strict=False):
        assert hi <= lo + 0.02, att


def test_drives_the_bucket_manager_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    # The simulator drives the controller's own dispatcher, which calls the policy functions, not copies of them.
    assert sim_module.Dispatcher is dispatcher_module.Dispatcher
    assert dispatcher_module.plan_batch is batch_plan.plan_batch
    assert dispatcher_module.choose_workers is memory_budget.choose_workers
    assert dispatcher_module.RequestBuckets is request_buckets.RequestBuckets
    calls = {"plan": 0, "adjust": 0}
    real_plan, real_adjust = batch_plan.plan_batch, request_buckets.RequestBuckets.adjust

    def spy_plan(*args, **kw):
        calls["plan"] += 1
        return real_plan(*args, **kw)

    def spy_adjust(self, n_max):
        calls["adjust"] += 1
        return real_adjust(self, n_max)

    monkeypatch.setattr(dispatcher_module, "plan_batch", spy_plan)
    monkeypatch.setattr(request_buckets.RequestBuckets, "adjust", spy_adjust)
    # Far above capacity the queue grows past N_max and Algorithm 1 splits the single bucket.
    loaded = simulate(config(), "mixed", 40.0, 300, seed=0).summary()
    assert calls["plan"] >= loaded["prefill_batches"] > 0
    assert calls["adjust"] > 0
    assert loaded["bucket_splits"] > 0 and loaded["max_request_buckets"] > 1
    light = simulate(config(), "mixed", 0.5, 100, seed=0).summary()
    assert light["max_request_buckets"] == 1
    baseline = simulate(config(request_buckets=False), "mixed", 40.0, 300, seed=0).summary()
    assert baseline["max_request_buckets"] == 1


def test_kv_reservations_all_returned() -> None:
    sim = Simulator(config(prefill_workers=2, decode_workers=2))
    lengths = [(random.Random(i).randint(10, 1500), random.Random(-i).randint(1, 200)) for i in range(120)]
    # Some requests end at their first token: they leave the prefill worker without a transfer.
    lengths[::10] = [(50, 1)] * len(lengths[::10])
    sim.run(lengths, [i * 0.05 for i in range(120)])
    assert all(not p.reserved and not p.outstanding for p in sim.prefill)
    assert all(not d.reserved and not d.running for d in sim.decode)
    assert len(sim.queue) == 0
    col = Simulator(config(mode="colocated", colocated_workers=2))
    col.run(lengths, [i * 0.05 for i in range(120)])
    assert all(w.free_blocks == w.total_blocks and w.in_flight == 0 for w in col.colocated)


def test_colocated_preempts_when_blocks_run_out() -> None:
    tight = replace(COST, num_blocks=300)
    sim = Simulator(SimConfig(tight, mode="colocated"))
    done = sim.run([(400, 300)] * 12, [0.0] * 12)
    assert sim.stats["preemptions"] > 0
    assert all(r.finish is not None for r in done)
    assert sim.colocated[0].free_blocks == 300


def test_prefill_fit_recovers_known_coefficients() -> None:
    truth = {
        "prefill_base_s": 4e-3,
        "prefill_per_seq_s": 1.5e-3,
        "prefill_per_token_s": 3e-4,
        "prefill_per_attn_s": 2e-7,
    }
    rng = random.Random(0)
    samples = []
    for b, q in [
        (1, 16),
        (1, 64),
        (1, 256),
        (1, 512),
        (1, 1024),
        (2, 64),
        (4, 128),
        (8, 32),
        (16, 16),
        (2, 512),
    ]:
        t = truth["prefill_base_s"] + truth["prefill_per_seq_s"] * b
        t += truth["prefill_per_token_s"] * b * q + truth["prefill_per_attn_s"] * b * q * q
        samples.append((b, q, t * (1 + rng.uniform(-0.002, 0.002))))
    fit = fit_prefill(samples)
    for k, v in truth.items():
        assert fit[k] == pytest.approx(v, rel=0.1), k


def test_decode_fit_recovers_known_coefficients() -> None:
    truth = {"decode_base_s": 8e-3, "decode_per_seq_s": 4e-4, "decode_per_block_s": 6e-5}
    rng = random.Random(1)
    samples = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for n in (b, 8 * b, 64 * b):
            t = truth["decode_base_s"] + truth["decode_per_seq_s"] * b + truth["decode_per_block_s"] * n
            samples.append((b, n, t * (1 + rng.uniform(-0.005, 0.005))))
    fit = fit_decode(samples)
    for k, v in truth.items():
        assert fit[k] == pytest.approx(v, rel=0.05), k


def test_nonnegative_fit_drops_a_term_that_would_be_negative() -> None:
    import numpy as np

    x = np.array([[1.0, float(i), float(i % 3)] for i in range(1, 12)])
    y = 2.0 + 0.5 * x[:, 1] - 0.3 * x[:, 2]
    coef = nonnegative_lstsq(x, y)
    assert (coef >= 0).all()
    assert coef[2] == 0.0


def test_cost_model_round_trip_and_committed_calibrations(tmp_path: Path) -> None:
    path = COST.save(tmp_path / "c.json", {"fit": {"x": 1}})
    assert CostModel.load(path) == COST
    for name in ("tiny", "small"):
        cal = CostModel.load(REPORTS_DIR / f"calibration_{name}.json")
        assert cal.name == name and cal.source.startswith("measured")
        # Costs grow with the work: a longer prompt and a bigger decode batch take longer.
        assert cal.prefill_s(1, 1024) > cal.prefill_s(1, 128) > 0
        assert cal.decode_s(32, 512) > cal.decode_s(1, 8) > 0
    with pytest.raises(ValueError, match="decode_base_s"):
        replace(COST, decode_base_s=-1.0)


def test_projections_follow_the_stated_figures() -> None:
    h100, gaudi2 = project("h100"), project("gaudi2")
    assert "projection" in h100.source and "projection" in gaudi2.source
    # Peak bf16 989 vs 432 TFLOP/s, 3.35 vs 2.45 TB/s: the H100 projects faster prefill and decode.
    assert h100.prefill_s(1, 1024) < gaudi2.prefill_s(1, 1024)
    assert h100.decode_s(32, 2048) < gaudi2.decode_s(32, 2048)
    assert gaudi2.block_size == 128 and h100.block_size == 16
    with pytest.raises(ValueError, match="hardware"):
        project("tpu")


def test_recommend_split_and_max_rate() -> None:
    result = recommend_split(config(), 4, "mixed", 6.0, 150)
    assert [(r["prefill_workers"], r["decode_workers"]) for r in result["splits"]] == [(1, 3), (2, 2), (3, 1)]
    best = max(r["slo_attainment"] for r in result["splits"])
    assert result["recommended_attainment"] == best
    rows = [{"request_rate": 1, "slo_attainment": 1.0}, {"request_rate": 3, "slo_attainment": 0.6}]
    assert max_rate_at(rows, 0.8) == pytest.approx(2.0)
    # A curve that dips and recovers: the highest rate meeting the target counts, as in bench sweep's report.
    bumpy = rows[:1] + [
        {"request_rate": 2, "slo_attainment": 0.7},
        {"request_rate": 4, "slo_attainment": 0.9},
    ]
    assert max_rate_at(bumpy + [{"request_rate": 6, "slo_attainment": 0.5}], 0.8) == pytest.approx(4.5)
    assert max_rate_at(bumpy, 0.8) == 4.0
    assert max_rate_at([{"request_rate": 1, "slo_attainment": 0.5}], 0.8) is None


def test_cli_prints_the_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cal = COST.save(tmp_path / "cal.json")
    argv = ["simulate", "--calibration", str(cal), "--rates", "1,8", "--num-prompts", "60", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    doc = json.loads(out[-1])
    assert [r["request_rate"] for r in doc["rows"]] == [1.0, 8.0]
    assert doc["rows"][0]["slo_attainment"] >= doc["rows"][1]["slo_attainment"]
    argv = ["simulate", "--hardware", "h100", "--prefill-workers", "2", "--decode-workers", "2"]
    argv += ["--rates", "20", "--num-prompts", "80", "--target-rate", "20"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(lines[-1])
    assert doc["split"]["cards"] == 4
    assert doc["split"]["recommended"] in {"1:3", "2:2", "3:1"}
    assert any(line.startswith("recommended prefill:decode") for line in lines)
    assert main(["simulate", "--calibration", str(tmp_path / "missing.json"), "--json"]) == 2


def test_validate_compares_measured_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cal = COST.save(tmp_path / "cal.json")
    runs = tmp_path / "runs"
    runs.mkdir()

    def point(name: str, attainment: float, ttft: float, tpot: float) -> None:
        doc = {
            "result": {"slo_attainment": attainment, "ttft_p50_ms": ttft, "tpot_p50_ms": tpot, "failed": 0}
        }
        (runs / f"{name}.json").write_text(json.dumps(doc))

    point("probe", 1.0, 150.0, 30.0)
    # The probe's requests, as bench serve writes them: the simulated lengths, 40 ms slower than simulated
    # (the first one far slower: it is left out).
    from bench.simulator.validate import PROBE_PROMPTS, PROBE_RATE

    probe_sim = simulate(config(slo_ttft_ms=500.0, slo_tpot_ms=50.0), "mixed", PROBE_RATE, PROBE_PROMPTS, 0)
    with (runs / "probe.requests.jsonl").open("w") as f:
        for i, r in enumerate(probe_sim.requests):
            ttft_ms = 1e3 * (r.first_token - r.arrival) + (900.0 if i == 0 else 40.0)
            row = {"request_id": f"bench-{i}", "input_len": r.prompt_len, "success": True, "ttft_ms": ttft_ms}
            f.write(json.dumps(row) + "\n")
    point("rate_1", 0.9, 160.0, 32.0)
    point("rate_8", 0.2, 3000.0, 80.0)
    calibration = {"slo_attainment": 0.5, "total_output_tokens": 20000, "client_cpu_s": 4.0, "failed": 0}
    (runs / "calibration.json").write_text(json.dumps({"result": calibration}))
    argv = ["simulate", "--validate", "--calibration", str(cal), "--measured", str(runs)]
    argv += ["--rates", "1,8", "--num-prompts", "60", "--out", str(tmp_path / "v"), "--json"]
    # No CPU measurement in the folder: refused, naming the file.
    assert main(argv) == 2
    assert "cpu.json" in capsys.readouterr().err
    cpu = {
        "idle_s": 10.0,
        "idle_cpu_s": {"prefill": 0.1, "decode": 0.2, "colocated": 0.0, "host": 1.0},
        "load_s": 20.0,
        "load_cpu_s": {"prefill": 6.2, "decode": 20.4, "colocated": 0.0, "host": 12.0},
        "cores": 2,
    }
    (runs / "cpu.json").write_text(json.dumps(cpu))
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["rate"] for r in doc["rows"]] == [1.0, 8.0]
    assert doc["calibration_rate"] == 8.0  # the median of the rates
    host = doc["host_model"]
    # Idle background (0.13 cores) is taken off the cores; host CPU under load less its background, plus the
    # client's, over the calibration's tokens.
    assert host["cores"] == pytest.approx(2 - 0.13)
    assert host["host_token_cpu_s"] == pytest.approx((12.0 - 0.1 * 20 + 4.0) / 20000)
    assert host["prefill_cpu_factor"] >= 1.0 and host["decode_cpu_factor"] >= 1.0
    # The host model slows the idle probe a little at most (idle: no contention), so the overhead is the 40 ms.
    assert doc["overhead_ms"] == pytest.approx(40.0, abs=5.0)
    assert doc["idle_probe_slowdown"] >= 1.0
    for r in doc["rows"]:
        expected = 100 * (r["simulated_attainment"] - r["measured_attainment"])
        assert r["error_points"] == pytest.approx(expected, abs=0.051)
    assert (tmp_path / "v.json").is_file() and (tmp_path / "v.md").is_file()
    assert main(argv[:5] + [str(tmp_path / "nothing"), "--json"]) == 2
