"""The Grafana dashboard the chart ships: rendered as a ConfigMap with the sidecar's discovery
label, and every panel's query names only metrics (with samples) and labels that a live gateway
really exports: a sim-engine fleet with agents and the gateway, driven by the agent workload with
prices, a trace recording and evictions, so every family the dashboard reads has samples."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate_tools.demo_workload import AgentWorkloadSpec, agent_sessions
from kvgate_tools.local_fleet import FleetOptions, LocalFleet, http_text
from kvgate_tools.operator_replay import replay_sessions
from tests.deploy.conftest import CHART, render

DASHBOARD = CHART / "dashboards" / "kvgate.json"
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "by", "without",
    "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "topk", "bottomk", "abs",
    "clamp_min", "clamp_max", "delta", "deriv", "sort", "sort_desc", "time", "vector", "scalar",
}  # fmt: skip


def _queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [t["expr"] for p in doc["panels"] for t in p["targets"]]


def test_chart_ships_the_dashboard_as_a_discoverable_configmap() -> None:
    assert not render({}).of_kind("ConfigMap") or all(
        not cm["metadata"]["name"].endswith("-dashboard") for cm in render({}).of_kind("ConfigMap")
    )
    r = render({"metrics": {"grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}}}})
    cm = r.one("ConfigMap", "kvgate-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = json.loads(cm["data"]["kvgate.json"])
    assert shipped == json.loads(DASHBOARD.read_text(encoding="utf-8"))
    ids = [p["id"] for p in shipped["panels"]]
    assert len(ids) == len(set(ids)) and len(ids) >= 10
    assert all(p["targets"] and all(t["expr"].strip() for t in p["targets"]) for p in shipped["panels"])


def _parse(expr: str) -> tuple[set[str], set[str], list[tuple[str, str]]]:
    """(metric names, label names in by()/selectors, (label, value) of equality matchers)."""
    body = expr.replace("$__rate_interval", "5m")
    matchers = re.findall(r'(\w+)\s*=\s*"([^"]*)"', body)
    regex_labels = re.findall(r'(\w+)\s*=~\s*"[^"]*"', body)
    grouped = [
        lab.strip() for g in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", body) for lab in g.split(",")
    ]
    stripped = re.sub(r'"[^"]*"', "", body)
    stripped = re.sub(r"\{[^}]*\}", "", stripped)
    stripped = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", stripped)
    stripped = re.sub(r"\[[^\]]*\]", "", stripped)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", stripped))
    metrics = {w for w in words if w not in PROMQL_WORDS}
    return metrics, {*grouped, *regex_labels, *(m[0] for m in matchers)}, matchers


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("dashboard")
    operator = {
        "trace": {"enabled": True, "path": str(tmp / "trace.jsonl"), "reorder_window_s": 0.2},
        "prices": {"kvgate-tiny": {"input": 0.27, "cached_input": 0.07}},
    }
    opts = FleetOptions(replicas=2, cache_blocks=400, time_scale=0.2, extra_config={"operator": operator},
                        log_dir=tmp / "logs")  # fmt: skip
    spec = AgentWorkloadSpec(tenants=6, sessions=16, turns=(2, 3), session_rate_per_s=8.0,
                             think_time_mean_s=2.0)  # fmt: skip
    with LocalFleet(opts) as fleet:
        result = asyncio.run(replay_sessions(fleet.gateway_url, agent_sessions(opts.model, spec)))
        assert result.errors == 0
        text = http_text(f"{fleet.gateway_url}/metrics")
    samples: dict[str, list[dict[str, str]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(dict(s.labels))
    return samples


@pytest.mark.timeout(300)
@pytest.mark.parametrize("expr", _queries())
def test_every_panel_query_reads_metrics_the_gateway_exports(
    expr: str, exported: dict[str, list[dict[str, str]]]
) -> None:
    metrics, labels, matchers = _parse(expr)
    assert metrics, expr
    for m in metrics:
        assert m in exported, f"{m} (in {expr!r}) is not exported; exported: {sorted(exported)}"
    known = {k for m in metrics for labelset in exported[m] for k in labelset}
    assert labels <= known, f"labels {sorted(labels - known)} not on {sorted(metrics)}"
    for label, value in matchers:
        values = {ls.get(label) for m in metrics for ls in exported[m]}
        assert value in values, f"{label}={value!r}: exported values {sorted(v for v in values if v)}"


def test_parser_catches_a_wrong_metric_name() -> None:
    metrics, labels, _ = _parse('sum by (tenant) (rate(kvgate_nonexistent_total{prefix="x"}[5m]))')
    assert metrics == {"kvgate_nonexistent_total"} and labels == {"tenant", "prefix"}
    assert Path(DASHBOARD).exists()
