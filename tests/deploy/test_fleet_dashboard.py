"""The second Grafana dashboard, "Fleet activity" (files/grafana-fleet-dashboard.json): shipped in
the chart's dashboard ConfigMap beside the pipeline dashboard, reading only the documented
activity metrics (deploy/README.md's metrics contract) that `ActivityMetrics` exports, with
bounded labels (no session, run or call id)."""

from __future__ import annotations

import json
import re

from prometheus_client import CollectorRegistry

from bridge.runtime import ActivityMetrics
from tests.support.chart import CHART_DIR, DEPLOY_README, ci_values, ours, render_manifests

FILE = CHART_DIR / "files" / "grafana-fleet-dashboard.json"


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(aep_bridge_[a-z_]+?)(?:_bucket)?(?=[{\[(\s])", expr + " "))


def test_the_chart_ships_both_dashboards_in_its_configmap() -> None:
    (cm,) = [m for m in ours(render_manifests(ci_values("monitoring"))) if m["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["aep-bridge.json"])["uid"] == "aep-bridge"
    fleet = json.loads(cm["data"]["aep-bridge-fleet.json"])
    assert fleet == json.loads(FILE.read_text())
    assert fleet["title"] == "Fleet activity" and fleet["uid"] == "aep-bridge-fleet"
    assert not [m for m in ours(render_manifests()) if m["kind"] == "ConfigMap"], "off by default, like the first"


def test_it_reads_the_documented_activity_metrics_with_bounded_labels() -> None:
    dashboard = json.loads(FILE.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    used = set().union(*(metric_names(e) for e in exprs))

    registry = CollectorRegistry()
    ActivityMetrics(registry)
    exported = {m.name + ("_total" if m.type == "counter" else "") for m in registry.collect()}
    assert used == exported, (used ^ exported)  # every activity metric has a panel, and only those
    documented = set(re.findall(r"^\| `(aep_bridge_[a-z_]+)`", DEPLOY_README.read_text(encoding="utf-8"), flags=re.M))
    assert used <= documented, used - documented

    titles = " | ".join(p["title"] for p in panels).lower()
    for topic in ("model calls", "tokens", "duration", "cost", "tool calls", "approvals", "runs"):
        assert topic in titles, topic
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            assert 'namespace="$namespace"' in expr and 'job="$pairing_job"' in expr, expr
            assert not re.search(r"\b(session|run|call_id|instance)\b", expr), expr
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "pairing_job", "model"} <= variables


def test_no_token_panel_adds_reasoning_to_output_again() -> None:
    """Hermes's output_tokens include the reasoning tokens (kind="reasoning" is their breakdown,
    bridge/core/pricing.py), so a panel that adds the kinds together leaves reasoning out: a
    total over every kind counted each reasoning token twice."""
    dashboard = json.loads(FILE.read_text())
    checked = 0
    for panel in dashboard["panels"]:
        stacked = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {}).get("stacking", {}).get("mode",
                                                                                                               "none")
        for target in panel.get("targets", []):
            expr = target["expr"]
            if "aep_bridge_model_tokens_total" not in expr:
                continue
            by_kind = re.search(r"by \([^)]*\bkind\b", expr) is not None
            adds_kinds = not by_kind or (panel["type"] == "timeseries" and stacked != "none")
            if adds_kinds:
                checked += 1
                assert 'kind!="reasoning"' in expr, (panel["title"], expr)
                assert "reasoning" in panel["description"], panel["title"]
    assert checked >= 1  # the Tokens stat at least


def test_the_metrics_contract_lists_the_mappers_usage_metrics() -> None:
    """deploy/README section 6's table names what the mapper counts of model calls: the calls
    the price table does not price and the numbers left out."""
    from bridge.services.mapper import MapperMetrics

    registry = CollectorRegistry()
    MapperMetrics(registry)
    usage = {m.name + "_total" for m in registry.collect() if m.type == "counter"
             and ("model" in m.name or "usage" in m.name)}
    assert usage == {"aep_bridge_model_unpriced_total", "aep_bridge_usage_invalid_total"}
    documented = set(re.findall(r"^\| `(aep_bridge_[a-z_]+)` \| counter \| `(?:model|field)` \| mapper \|",
                                DEPLOY_README.read_text(encoding="utf-8"), flags=re.M))
    assert usage <= documented, usage - documented
