"""The stages of a request's way (``monitor/stages.py``): from the marks the processes stamp to seconds per stage,
into the record, the /metrics histogram and the dashboard's figures. Pure figures: no cluster here (the cluster's
own marks are checked end to end in ``test_cluster_gateway.py``)."""

from __future__ import annotations

import pytest
from monitor_helpers import T0, FakeClock, request

from monitor import Monitor, MonitorConfig, stages
from monitor.records import RequestRecord

# A disaggregated request: 3 ms admission, 2 ms controller queue, 5 ms prefill queue, 40 ms forward, 4 ms out;
# its KV lands 6 ms after the forward and the decode worker's first step ends 12 ms later.
MARKS = {
    stages.RECEIVED: 100.000,
    stages.SUBMITTED: 100.003,
    stages.DISPATCHED: 100.005,
    stages.FORWARD_START: 100.010,
    stages.FORWARD_END: 100.050,
    stages.FIRST_TOKEN: 100.054,
    stages.KV_RECEIVED: 100.056,
    stages.DECODE_FIRST: 100.068,
}


def test_stages_of_a_disaggregated_request_sum_to_its_time_to_first_token() -> None:
    got = stages.stage_seconds(MARKS)
    want = {
        "admission": 0.003,
        "controller_queue": 0.002,
        "prefill_queue": 0.005,
        "prefill_forward": 0.040,
        "first_token_out": 0.004,
        "kv_transfer": 0.006,
        "decode_join": 0.012,
        "overhead": 0.014,
    }
    assert list(got) == list(want)  # in the order a request passes them
    assert got == pytest.approx(want, abs=1e-9)
    ttft = sum(got[name] for name, _ in stages.TTFT_STAGES)
    assert ttft == pytest.approx(MARKS[stages.FIRST_TOKEN] - MARKS[stages.RECEIVED])


def test_a_missing_mark_folds_its_stage_into_the_next() -> None:
    # Colocated: no controller, so the prefill queue runs from the submission.
    marks = {k: v for k, v in MARKS.items() if k not in (stages.DISPATCHED, stages.KV_RECEIVED)}
    got = stages.stage_seconds(marks)
    assert "controller_queue" not in got and "kv_transfer" not in got and "decode_join" not in got
    assert got["prefill_queue"] == pytest.approx(0.007)
    assert got["overhead"] == pytest.approx(0.014)


def test_no_forward_pass_stamped_names_no_stage() -> None:
    # A backend that reports no stages: nothing is attributed to a stage it did not measure.
    marks = {stages.RECEIVED: 1.0, stages.SUBMITTED: 1.1, stages.FIRST_TOKEN: 2.0}
    assert stages.stage_seconds(marks) == {}


def test_clocks_that_disagree_never_give_a_negative_stage() -> None:
    # The controller's clock runs 3 ms behind the gateway's: its mark comes "before" the submission.
    marks = dict(MARKS, **{stages.DISPATCHED: 100.000})
    got = stages.stage_seconds(marks)
    assert got["controller_queue"] == 0.0
    assert all(v >= 0 for v in got.values())
    ttft = sum(got[name] for name, _ in stages.TTFT_STAGES)
    assert ttft == pytest.approx(MARKS[stages.FIRST_TOKEN] - MARKS[stages.RECEIVED])


def test_a_record_names_only_known_stages_in_seconds() -> None:
    with pytest.raises(ValueError, match="unknown stage 'tokenize'"):
        request("r", stages={"tokenize": 0.001})
    with pytest.raises(ValueError, match=r"\['admission'\] must be a number of seconds >= 0"):
        request("r", stages={"admission": -0.001})
    rec = request("r", stages=stages.stage_seconds(MARKS))
    assert RequestRecord.from_dict(rec.to_dict()) == rec


def test_stages_reach_the_metrics_histogram_and_the_dashboard() -> None:
    clock = FakeClock(T0 + 60)
    mon = Monitor(MonitorConfig(), clock=clock)
    forwards = [0.010, 0.020, 0.030, 0.040]
    for i, forward in enumerate(forwards):
        spent = {"admission": 0.002, "prefill_forward": forward, "overhead": 0.008 + i * 0.001}
        assert mon.record_request(request(f"r{i}", arrival=T0, stages=spent))
    text = mon.metrics_text("tiny")
    lines = [line for line in text.splitlines() if line.startswith("bucketserve:request_stage_seconds")]
    count = 'bucketserve:request_stage_seconds_count{model_name="tiny",stage="prefill_forward"} 4.0'
    total = 'bucketserve:request_stage_seconds_sum{model_name="tiny",stage="prefill_forward"}'
    assert count in lines
    assert float(next(line for line in lines if line.startswith(total)).split()[-1]) == pytest.approx(0.1)
    data = mon.dashboard_data(300)["stages"]
    assert list(data) == ["admission", "prefill_forward", "overhead"]
    assert data["prefill_forward"]["count"] == 4
    assert data["prefill_forward"]["mean_ms"] == pytest.approx(25.0)
    # The sketch reads back within its 2% relative accuracy (lower-rank median of 10, 20, 30, 40 ms: 20).
    assert data["prefill_forward"]["p50_ms"] == pytest.approx(20.0, rel=0.02)
    assert data["overhead"]["p90_ms"] == pytest.approx(10.0, rel=0.02)  # rank 0.9 * (4 - 1) of 8..11 ms
    mon.close()
