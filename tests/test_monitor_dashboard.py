"""The dashboard page: self-contained, stable ids, and its JS draws real dashboard data (run in node)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from monitor_helpers import T0, FakeClock, request, worker

import monitor.dashboard
from monitor.dashboard import page_html
from monitor.monitor import Monitor
from monitor.records import BatchRecord

IDS = (
    "slo-chart",
    "slo-headline",
    "goodput-chart",
    "rate-chart",
    "ttft-chart",
    "tpot-chart",
    "tokens-chart",
    "buckets-chart",
    "bucket-boundaries",
    "queue-chart",
    "kv-chart",
    "mem-chart",
    "workers-table",
    "health-headline",
    "compilations",
    "scaling",
    "window-select",
    "status",
)
JS = Path(monitor.dashboard.__file__).with_name("dashboard.js")


def test_page_is_self_contained() -> None:
    page = page_html(data_url="/api/dash?x=1&y=2", refresh_ms=5000)
    for element_id in IDS:
        assert page.count(f'id="{element_id}"') == 1, element_id
    assert 'data-url="/api/dash?x=1&amp;y=2"' in page and 'data-refresh-ms="5000"' in page
    assert "<style>" in page and "function lineChartSvg" in page
    # Nothing is fetched from anywhere: no external URLs, no src/href attributes left but inline data.
    assert not re.search(r"https?://", page)
    assert not re.search(r'\b(src|href)="(?!data:)', page)
    with pytest.raises(ValueError, match="refresh_ms"):
        page_html(refresh_ms=10)


def _node() -> str:
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.fail(
            "node is needed to run the dashboard's chart code outside a browser: apt-get install nodejs"
        )
    return node


def _busy_monitor() -> Monitor:
    clock = FakeClock(T0)
    mon = Monitor(clock=clock)
    for step in range(12):  # two minutes of traffic, a heartbeat and a bucket push every 10 s
        mon.report_worker(worker("prefill-0", role="prefill", kv_blocks_used=step, kv_blocks_free=100 - step))
        if step < 6:
            mon.report_worker(worker("decode-0", runtime_compilations=1))
        mon.set_buckets([0, 128, 512, 2048], [step % 3, 1, 0])
        for i in range(5):
            mon.record_arrival("online", 100)
            mon.record_request(
                request(
                    f"s{step}-{i}",
                    arrival=clock.t,
                    e2e_s=0.5,
                    slo_met=i != 0,
                    ttft_s=0.02 * (i + 1),
                    stages={"admission": 0.002, "prefill_forward": 0.01 * (i + 1), "kv_transfer": 0.004},
                )
            )
        mon.record_request(request(f"o{step}", arrival=clock.t, priority_class="offline", e2e_s=0.5))
        mon.record_batch(BatchRecord("prefill-0", "prefill", 5, 400, 512, clock.t))
        clock.advance(10)
    mon.record_scaling("prefill", "up")
    mon.record_scaling("prefill", "up")
    mon.record_scaling("prefill", "down")
    mon.record_lent_batch("decode-0", 3)
    mon.record_lent_batch("decode-0", 2)
    mon.record_core_lend("decode-0")
    return mon


def _build_view(data: dict) -> dict[str, str]:
    script = f"const d = require({json.dumps(str(JS))}); process.stdout.write(JSON.stringify(d.buildView(JSON.parse(require('fs').readFileSync(0, 'utf8')))));"
    out = subprocess.run(
        [_node(), "-e", script],
        input=json.dumps(data),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _points(svg: str) -> int:
    return int(re.search(r'data-points="(\d+)"', svg).group(1))  # type: ignore[union-attr]


def test_charts_draw_dashboard_data() -> None:
    data = _busy_monitor().dashboard_data(window_s=300)
    view = _build_view(data)
    assert set(IDS) - {"window-select", "status"} <= set(view)
    # One point per 10 s slot with traffic (12), per class.
    assert _points(view["slo-chart"]) == 24
    assert 'data-series="online"' in view["slo-chart"] and 'data-series="offline"' in view["slo-chart"]
    assert _points(view["ttft-chart"]) == 36  # p50, p90, p99
    assert "80.0%" in view["slo-headline"], "4 of 5 online requests met their SLO"
    assert view["buckets-chart"].count("<rect") == 3
    assert 'data-bucket="512-2048"' in view["buckets-chart"]
    assert "0 | 128 | 512 | 2048" in view["bucket-boundaries"]
    assert _points(view["kv-chart"]) == 12 + 6
    table = view["workers-table"]
    assert table.count("<tr data-worker=") == 2
    assert 'data-worker="decode-0" class="is-down"' in table, "decode-0 stopped reporting a minute ago"
    assert ">1</span>" in view["compilations"]
    assert data["scaling_events"]["prefill"] == {"up": 2, "down": 1}
    assert ">3</span>" in view["scaling"] and "prefill +2 / \u22121, decode +0 / \u22120" in view["scaling"]
    assert "1 / 2" in view["health-headline"]
    assert data["lending"] == {"decode-0": {"batches": 2, "prompts": 5, "core_batches": 1}}
    assert ">2</span>" in view["lending"] and "(5 prompts)" in view["lending"]
    assert "1 prefill batches ran on a decode worker's cores too" in view["lending"]
    stages = view["stages-table"]
    assert [m for m in re.findall(r'data-stage="(\w+)"', stages)] == [
        "admission",
        "prefill_forward",
        "kv_transfer",
    ]
    assert "<td>prefill_forward</td><td>time to first token</td><td>60</td><td>30.0</td>" in stages
    assert "<td>kv_transfer</td><td>hand-off to decode</td>" in stages


def test_charts_when_nothing_has_happened() -> None:
    view = _build_view(Monitor(clock=FakeClock()).dashboard_data())
    assert _points(view["slo-chart"]) == 0
    assert "no worker has reported yet" in view["workers-table"]
    assert "not pushed" in view["buckets-chart"]
    assert "no data in this window" in view["slo-chart"]
    assert "no request with measured stages" in view["stages-table"]
