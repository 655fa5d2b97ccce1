"""The Grafana dashboard queries only metrics we export, all of them, always filtered by model."""

from __future__ import annotations

import json
import re
from pathlib import Path

from monitor import metrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana_dashboard.json"
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def _exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


def _family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in metrics.METRIC_NAMES:
            return name[: -len(suffix)]
    return name


def test_queries_use_exported_metrics_only_and_cover_them_all() -> None:
    used = set()
    for expr in _exprs():
        for name in re.findall(r"bucketserve:[a-z0-9_]+", expr):
            family = _family(name)
            assert family in metrics.METRIC_NAMES, f"{name} in {expr!r} is not exported"
            used.add(family)
    assert set(metrics.METRIC_NAMES) - used == set(), "every exported family has a panel"


def test_every_query_filters_by_model() -> None:
    for expr in _exprs():
        selectors = re.findall(r"bucketserve:[a-z0-9_]+(\{[^}]*\})?", expr)
        assert selectors and all('model_name=~"$model_name"' in s for s in selectors), expr


def test_layout_is_sane() -> None:
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert board["panels"][0]["title"].startswith("SLO attainment")
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "model_name"}
