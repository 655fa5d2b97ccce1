"""bench sweep: the rate at the target attainment (interpolated), the ratios between systems, the SLOs derived
from unloaded figures, and the report files, all on synthetic results (no server)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import pytest

from bench.metrics import RateAtTarget, rate_at_target, ratio
from bench.server_process import ServerProcess
from bench.sweep import _burstiness, _offline_slo_scale, _rates, _systems, colocated_note, derive_slos
from bench.sweep_report import SystemRun, build_doc, write_sweep_report
from bench.sweep_systems import median_request, offline_slos, system_command
from bench.workload_requests import BenchRequest

# --------------------------------------------------------------------------- rate at the target


def test_interpolates_between_the_last_rate_meeting_the_target_and_the_next() -> None:
    r = rate_at_target([(1.0, 1.0), (2.0, 0.9), (4.0, 0.5)], 0.8)
    assert r.kind == "interpolated"
    # 0.9 -> 0.5 over 2 -> 4 req/s: 0.8 is a quarter of the way.
    assert r.rate == pytest.approx(2.5)


def test_exactly_at_target_is_that_rate() -> None:
    r = rate_at_target([(1.0, 0.95), (2.0, 0.8), (3.0, 0.2)], 0.8)
    assert r.rate == pytest.approx(2.0) and r.kind == "interpolated"


def test_the_highest_rate_meeting_the_target_counts_even_after_a_dip() -> None:
    # A noisy dip below the target at 2 req/s does not hide that 3 req/s met it.
    r = rate_at_target([(1.0, 0.9), (2.0, 0.7), (3.0, 0.85), (4.0, 0.35)], 0.8)
    assert r.rate == pytest.approx(3.0 + (0.85 - 0.8) / (0.85 - 0.35))


def test_all_met_is_a_lower_bound_and_none_met_an_upper_one() -> None:
    assert rate_at_target([(0.5, 1.0), (1.0, 0.9)], 0.8) == RateAtTarget(1.0, "at_least")
    assert rate_at_target([(0.5, 0.6), (1.0, 0.1)], 0.8) == RateAtTarget(0.5, "below")
    assert rate_at_target([], 0.8) == RateAtTarget(None, "none")


def test_skipped_rates_are_ignored_and_order_does_not_matter() -> None:
    r = rate_at_target([(4.0, None), (2.0, 0.4), (1.0, 1.0)], 0.8)
    assert r.rate == pytest.approx(1.0 + 0.2 / 0.6) and r.kind == "interpolated"


# --------------------------------------------------------------------------- ratios


def test_ratio_of_two_interpolated_rates_is_exact() -> None:
    got = ratio(RateAtTarget(3.0, "interpolated"), RateAtTarget(1.5, "interpolated"))
    assert got.value == pytest.approx(2.0) and got.relation == "=" and got.text() == "2.00x"


def test_ratio_with_bounds() -> None:
    exact, low_bound = RateAtTarget(2.0, "interpolated"), RateAtTarget(4.0, "at_least")
    assert ratio(low_bound, exact).relation == ">="
    assert ratio(exact, low_bound).relation == "<="
    below = RateAtTarget(0.5, "below")
    got = ratio(exact, below)
    assert got.relation == ">" and got.value == pytest.approx(4.0)
    assert ratio(below, exact).relation == "<"
    assert ratio(below, below).value is None
    assert ratio(exact, RateAtTarget(None, "none")).value is None


# --------------------------------------------------------------------------- SLOs


def test_slos_are_five_times_the_unloaded_figures_of_the_reference() -> None:
    unloaded = {"fcfs": {"ttft_ms": 10.0, "tpot_ms": 1.0}, "ours": {"ttft_ms": 80.0, "tpot_ms": 12.0}}
    slo = derive_slos(unloaded, "ours", 5.0)
    assert slo["ttft_ms"] == pytest.approx(400.0) and slo["tpot_ms"] == pytest.approx(60.0)
    assert "ours" in slo["source"]["ttft_ms"] and "80.00" in slo["source"]["ttft_ms"]


def test_given_slos_win_and_a_missing_reference_falls_back() -> None:
    unloaded = {"fcfs": {"ttft_ms": 20.0, "tpot_ms": 3.0}}
    slo = derive_slos(unloaded, "ours", 5.0, ttft_ms=500.0)
    assert slo["ttft_ms"] == 500.0 and slo["source"]["ttft_ms"] == "given"
    assert slo["tpot_ms"] == pytest.approx(15.0) and "fcfs" in slo["source"]["tpot_ms"]
    # A TPOT of zero (static batching sends every token at once) gives no bound.
    assert derive_slos({"static": {"ttft_ms": 900.0, "tpot_ms": 0.0}}, "ours")["tpot_ms"] is None


def test_median_request_is_the_median_prompt_length() -> None:
    class R:
        def __init__(self, n: int) -> None:
            self.input_len = n

    assert median_request([R(n) for n in (900, 10, 50, 30, 2000)]).input_len == 50
    assert median_request([R(n) for n in (40, 10, 30, 20)]).input_len == 20


# --------------------------------------------------------------------------- command line


def test_rates_and_systems_parse() -> None:
    assert _rates("4,0.5,1,1") == [0.5, 1.0, 4.0]
    for bad in ("", "a,b", "0,1", "-1", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            _rates(bad)
    # The reference system runs first, whatever the order given: the others' SLOs come from it.
    assert _systems("static,vllm,ours,fcfs") == ["ours", "static", "vllm", "fcfs"]
    with pytest.raises(argparse.ArgumentTypeError, match="nope"):
        _systems("ours,nope")
    assert _burstiness("0.25") == 0.25
    for bad in ("0", "-1", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--burstiness"):
            _burstiness(bad)


def test_offline_requests_may_be_judged_on_looser_bounds() -> None:
    assert _offline_slo_scale("5") == 5.0
    for bad in ("0.5", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--offline-slo-scale"):
            _offline_slo_scale(bad)
    reqs = [BenchRequest("a", 10, 8, 0.0, priority=c) for c in ("online", "offline", None)]
    assert offline_slos(reqs, 600.0, 80.0, 1.0) == reqs
    online, offline, unclassed = offline_slos(reqs, 600.0, 80.0, 5.0)
    assert (offline.slo_ttft_ms, offline.slo_tpot_ms) == (3000.0, 400.0)
    assert online == reqs[0] and unclassed == reqs[2], "online and unclassed requests keep the run's SLOs"


def test_system_commands() -> None:
    args = argparse.Namespace(
        model="small",
        max_model_len=2048,
        colocated_workers=2,
        static_batch_size=8,
        serve_args="--skip-warmup",
        vllm_python="/opt/v/bin/python",
    )
    ours, _ = system_command("ours", args, 1234)
    fcfs, _ = system_command("fcfs", args, 1234)
    assert (
        ours[ours.index("--scheduling") + 1] == "buckets" and fcfs[fcfs.index("--scheduling") + 1] == "fcfs"
    )
    assert "--skip-warmup" in ours and "--port" in ours and "127.0.0.1" in ours
    colo, _ = system_command("colocated", args, 1)
    assert (
        colo[colo.index("--mode") + 1] == "colocated" and colo[colo.index("--colocated-workers") + 1] == "2"
    )
    static, _ = system_command("static", args, 1)
    assert (
        static[static.index("-m") + 1] == "bench.baselines.static_batching" and "--skip-warmup" not in static
    )
    vllm, env = system_command("vllm", args, 99)
    assert vllm[:2] == ["/opt/v/bin/vllm", "serve"] and "VLLM_CPU_KVCACHE_SPACE" in env
    assert vllm[vllm.index("--served-model-name") + 1] == "small"


# --------------------------------------------------------------------------- report


def _point(rate: float, attainment: float | None, skipped: bool = False) -> dict:
    if skipped:
        return {"request_rate": rate, "skipped": True}
    return {
        "request_rate": rate,
        "slo_attainment": attainment,
        "failed": 0,
        "ttft_p50_ms": 50.0,
        "ttft_p99_ms": 90.0,
        "tpot_p50_ms": 8.0,
        "tpot_p99_ms": 12.0,
        "goodput_rps": rate * (attainment or 0),
        "output_tok_per_s": 100.0,
    }


def _runs() -> list[SystemRun]:
    return [
        SystemRun("ours", ["x"], None, 60.0, {"ttft_ms": 40.0, "tpot_ms": 8.0},
                  [_point(1, 1.0), _point(2, 0.9), _point(4, 0.6)]),
        SystemRun("fcfs", ["y"], None, 61.0, {"ttft_ms": 41.0, "tpot_ms": 8.1},
                  [_point(1, 0.9), _point(2, 0.6), _point(4, 0.01, True)]),
        SystemRun("vllm", ["z"], "RuntimeError: exited with code 1: no such flag"),
    ]  # fmt: skip


def test_report_files_tables_and_plot(tmp_path: Path) -> None:
    config = {
        "workload": "mixed",
        "rates": [1.0, 2.0, 4.0],
        "systems": ["ours", "fcfs", "vllm"],
        "num_prompts": 40,
        "model": "small",
        "seed": 0,
        "target": 0.8,
        "max_model_len": 2048,
        "max_output_len": 128,
        "stop_below": 0.05,
    }
    slo = derive_slos({"ours": {"ttft_ms": 40.0, "tpot_ms": 8.0}})
    doc = build_doc(config, slo, _runs(), ["shared machine"])
    paths = write_sweep_report(tmp_path / "out", doc)
    data = json.loads(paths["json"].read_text())
    # ours: 0.9 -> 0.6 over 2 -> 4: 2 + 2/3 req/s; fcfs: 0.9 -> 0.6 over 1 -> 2: 1 + 1/3.
    assert data["rate_at_target"]["ours"]["rate"] == pytest.approx(2 + 2 / 3)
    assert data["rate_at_target"]["fcfs"]["rate"] == pytest.approx(1 + 1 / 3)
    assert data["rate_at_target"]["vllm"] == {"rate": None, "kind": "none"}
    assert data["ratios"]["ours/fcfs"]["value"] == pytest.approx(2.0)
    assert data["ratios"]["ours/fcfs"]["relation"] == "="
    assert data["ratios"]["ours/vllm"]["value"] is None
    assert data["slo"]["ttft_ms"] == pytest.approx(200.0) and data["slo"]["tpot_ms"] == pytest.approx(40.0)
    md = paths["md"].read_text()
    assert "| ours | (a) | 2.67 |" in md and "| fcfs | (b) | 1.33 |" in md
    assert "| ours/fcfs | 2.00x |" in md
    assert "no such flag" in md and "skipped" in md and "shared machine" in md
    assert "TTFT <= 200.00 ms" in md
    assert "arrivals: Poisson; all online." in md
    bursty = build_doc({**config, "burstiness": 0.25, "priority_mix": "1:1"}, slo, _runs(), [])
    bursty_md = write_sweep_report(tmp_path / "bursty", bursty)["md"].read_text()
    assert "gamma gaps of shape 0.25 (bursts); classes online:offline 1:1." in bursty_md
    assert "Offline requests" not in bursty_md
    two_slos = build_doc({**config, "priority_mix": "1:1", "offline_slo_scale": 5.0}, slo, _runs(), [])
    two_md = write_sweep_report(tmp_path / "two", two_slos)["md"].read_text()
    assert "Offline requests meet their SLO within 5x both bounds." in two_md
    assert "outputs up to 128 tokens; load from bench.client;" in md
    outside = build_doc({**config, "workload": "random", "client": "vllm bench serve"}, slo, _runs(), [])
    outside_md = write_sweep_report(tmp_path / "outside", outside)["md"].read_text()
    assert "prompts of 256 +- 90% tokens, 64 out; load from vllm bench serve;" in outside_md
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert not any(math.isnan(x) for x in (data["slo"]["ttft_ms"], data["slo"]["tpot_ms"]))


# --------------------------------------------------------------------------- process group


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    """A server that ignores SIGINT, with a child that left its process group (but not its session):
    stop() still ends both."""
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import os, signal, time; os.setpgrp(); signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    server = ServerProcess([sys.executable, "-c", script], {}, tmp_path / "logs" / "s.log")
    deadline = time.monotonic() + 20
    while not server.log_tail().strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(server.log_tail().split()[0])
    assert _running(os.getpid())  # /proc works here, or the checks below prove nothing
    assert server.alive() and _running(child)
    server.stop(grace_s=1.0)
    assert not server.alive()
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(child)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"  # a zombie has exited


def test_keep_from_carries_the_slos_and_the_systems_not_rerun(tmp_path: Path) -> None:
    from bench.sweep_report import kept_from

    config = {"workload": "mixed", "rates": [1.0, 2.0, 4.0], "model": "small", "target": 0.8}
    doc = build_doc(config, derive_slos({"ours": {"ttft_ms": 40.0, "tpot_ms": 8.0}}), _runs())
    paths = write_sweep_report(tmp_path, {**doc, "config": {**config, "num_prompts": 40, "seed": 0,
                                                            "max_model_len": 2048, "max_output_len": 128}})  # fmt: skip
    slo, kept = kept_from(json.loads(paths["json"].read_text()), ["fcfs"])
    assert [r.name for r in kept] == ["ours", "vllm"]
    assert kept[0].points[1]["slo_attainment"] == 0.9 and kept[0].unloaded["ttft_ms"] == 40.0
    assert slo["ttft_ms"] == pytest.approx(200.0)


def test_the_report_names_the_colocated_system_size() -> None:
    assert (
        colocated_note(2)
        == "Our colocated system runs 2 workers, as (a) and (b) run one prefill and one decode worker."
    )
    assert "one worker with all the cores" in colocated_note(1)
    assert "3 workers;" in colocated_note(3)


# --------------------------------------------------------------------------- the same requests at every rate


def test_same_prompts_send_one_set_of_requests_at_every_rate() -> None:
    from bench.workload_requests import draw_seed, make_requests
    from engine.model_loader import load_tokenizer

    tokenizer = load_tokenizer("tiny")

    def load(rate: float, same: bool):
        seed = draw_seed(0, rate, same_every_rate=same)
        return make_requests(
            "random", 12, rate, tokenizer, seed=seed, burstiness=0.25, online_share=0.5, max_model_len=512
        )

    slow, fast = load(2.0, True), load(8.0, True)
    assert [r.prompt for r in slow] == [r.prompt for r in fast]
    assert [r.priority for r in slow] == [r.priority for r in fast]
    # The same bursts, four times as fast.
    assert [r.send_at for r in fast] == pytest.approx([r.send_at / 4 for r in slow])
    assert [r.prompt for r in load(2.0, False)] != [
        r.prompt for r in load(8.0, False)
    ]  # the default: a draw each


@pytest.mark.parametrize(
    "extra",
    [["--systems", "ours,vllm"], ["--systems", "ours", "--serve-args=--prefix-caching"]],
)
def test_same_prompts_refuse_a_prefix_cache(extra: list[str], capsys) -> None:
    from bench.sweep import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["sweep", "--rates", "1,2", "--same-prompts", *extra])
    assert args.func(args) == 2
    assert "--same-prompts" in capsys.readouterr().err


def test_keep_from_must_have_seen_the_same_kind_of_requests(tmp_path: Path, capsys) -> None:
    from bench.sweep import register

    config = {"workload": "mixed", "rates": [1.0, 2.0, 4.0], "model": "small", "target": 0.8}
    doc = build_doc(config, derive_slos({"ours": {"ttft_ms": 40.0, "tpot_ms": 8.0}}), _runs())
    config = {**config, "num_prompts": 40, "seed": 0, "max_model_len": 2048, "max_output_len": 128}
    paths = write_sweep_report(tmp_path, {**doc, "config": config})  # no same_prompts: a draw per rate
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        ["sweep", "--rates", "1,2", "--systems", "fcfs", "--same-prompts", "--keep-from", str(paths["json"])]
    )
    assert args.func(args) == 2
    assert "was measured without --same-prompts" in capsys.readouterr().err
