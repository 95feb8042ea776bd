"""deploy/grafana/dashboards/seqstate.json names only metrics the code exports.

Every PromQL expression of every panel and template variable is parsed for its metric names
(tests/support/promql_labels.py), and each must be a series name the code's registry exposes,
histogram and counter suffixes included. A renamed metric then fails here, not on an
operator's blank panel.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from promql_labels import dashboard_queries, metric_names, problems

from projector.ops.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "seqstate.json"


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside rows included (test_compose reads their data sources)."""
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


# The series names the Prometheus text format gives a family of each type.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count"),
}


@pytest.fixture(scope="module")
def exported_names() -> set[str]:
    """Every series name a process's registry can expose. The collectors yield each family
    even with no sample (no consumer followed yet), so the names do not depend on a run."""
    names: set[str] = set()
    for family in Metrics().registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def test_the_registry_exports_the_documented_families(exported_names):
    for name in (
        "seqstate_worker_active_blocks",
        "seqstate_events_total",
        "seqstate_flush_seconds_bucket",
        "seqstate_lag_seconds",
    ):
        assert name in exported_names


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('seqstate_lag_events{namespace=~"$namespace"}', {"seqstate_lag_events"}),
        ('histogram_quantile(0.99, sum by (le, role) (rate(x_bucket{a="b"}[5m])))', {"x_bucket"}),
        ("topk(10, a) / on (worker) group_left b offset 5m", {"a", "b"}),
        ("label_values(seqstate_applied_seq, namespace)", {"seqstate_applied_seq"}),
        ("sum(rate(a_total[1m])) * 1e3 > bool 0.5", {"a_total"}),
    ],
)
def test_metric_names_are_read_from_promql(expr, names):
    assert metric_names(expr) == names


@pytest.mark.parametrize(
    ("expr", "exported", "found"),
    [
        ('sum by (worker) (a{namespace=~"x"})', {"a": {"namespace", "worker"}}, []),
        (
            "sum by (worker) (a)",
            {"a": {"worker_id"}},
            ["sum by 'worker': not a label of its argument"],
        ),
        ('a{wrong="1"}', {"a": {"namespace"}}, ["a has no label 'wrong'"]),
        ("b", {"a": set()}, ["no metric b"]),
        ("a - on (w) b", {"a": {"w"}, "b": {"v"}}, ["on (w): not a label of the right side"]),
        (
            'sum by (w) (a) - on (w) max by (w) (label_replace(b, "w", "$1", "v", "(.*)"))',
            {"a": {"w"}, "b": {"v"}},
            [],
        ),
        (
            'label_replace(b, "w", "$1", "u", "(.*)")',
            {"b": {"v"}},
            ["label_replace reads 'u': not a label of its argument"],
        ),
        ("histogram_quantile(0.5, sum by (le) (rate(h_bucket[5m])))", {"h_bucket": {"le"}}, []),
        ("topk(3, a) > bool 1", {"a": {"x"}}, []),
        ("sum(a) by (x)", {"a": {"y"}}, ["sum by 'x': not a label of its argument"]),
        ("label_values(a, x)", {"a": {"y"}}, ["label_values: 'x' is not a label of its metric"]),
    ],
)
def test_labels_are_checked_where_promql_reads_them(expr, exported, found):
    assert problems(expr, exported) == found


@pytest.mark.parametrize("uid", ["seqstate", "seqstate-dynamo"])
def test_dashboard_is_a_grafana_dashboard_with_unique_panels(uid):
    dashboard = json.loads((DASHBOARD.parent / f"{uid}.json").read_text())
    assert dashboard["uid"] == uid and dashboard["schemaVersion"] >= 36
    every = panels(dashboard)
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids)), ids
    for panel in every:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]
        if panel["type"] != "row":
            assert refs and panel.get("description"), panel["title"]


def test_every_metric_the_dashboard_names_is_exported(dashboard, exported_names):
    named = set().union(*(metric_names(e) for e in dashboard_queries(DASHBOARD)))
    assert named, "the dashboard names no metric"
    missing = sorted(named - exported_names)
    assert not missing, f"the dashboard names metrics the code does not export: {missing}"
