"""What the chart refuses: values its schema rejects, combinations its templates fail on with a
message, and Helm's own lint of the chart for every values file."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from tests.deploy.conftest import CASES, CHART, render

SCHEMA = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("values", [pytest.param(v, id=c) for c, v in CASES])
def test_helm_lint_is_clean(values: dict[str, Any]) -> None:
    report = helm.lint(str(CHART), values, strict=True, namespace="llm", kube_version="v1.25.0")
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    # Severity 2 is a warning, 3 an error; info (1) is only "icon is recommended".
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_lint_reports_a_broken_values_file() -> None:
    report = helm.lint(str(CHART), {"gateway": {"replicas": "two"}}, strict=True)
    assert report["errors"], "lint passed values the schema forbids"


def test_default_values_satisfy_the_schema() -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    jsonschema.validate(defaults, SCHEMA, cls=jsonschema.Draft202012Validator)


def test_schema_refuses_unknown_keys_at_every_level_of_the_chart() -> None:
    def walk(node: dict[str, Any], path: str) -> list[str]:
        found = []
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, f"{path or '.'} accepts unknown keys"
            for key, sub in node["properties"].items():
                found += walk(sub, f"{path}.{key}".lstrip("."))
            found.append(path)
        return found

    objects = walk(SCHEMA, "")
    assert "gateway" in objects and "engineExample.vllm.image" in objects
    for name, sub in SCHEMA["$defs"].items():
        if name != "gateway.PolicyConfig":  # policy parameters are checked by the policy registry
            assert sub.get("additionalProperties") is False, name


# (values, the path or words Helm's schema error names)
BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"replicaCount": 2}, "additional properties 'replicaCount' not allowed"),
    ({"gateway": {"replicas": "three"}}, "/gateway/replicas"),
    ({"gateway": {"replicas": 0}}, "/gateway/replicas"),
    ({"gateway": {"ports": {"http": 70000}}}, "/gateway/ports/http"),
    ({"gateway": {"resource": {}}}, "additional properties 'resource' not allowed"),
    ({"service": {"type": "Ingress"}}, "/service/type"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"redis": {"enabled": "yes"}}, "/redis/enabled"),
    ({"redis": {"maxMemory": "lots"}}, "/redis/maxMemory"),
    ({"podDisruptionBudget": {"maxUnavailable": "half"}}, "/podDisruptionBudget/maxUnavailable"),
    ({"autoscaling": {"targetCPUUtilizationPercentage": 150}}, "/autoscaling/targetCPUUtilizationPercentage"),
    ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "/metrics/serviceMonitor/interval"),
    ({"agent": {"eventsEndpoint": "ipc:///tmp/events"}}, "/agent/eventsEndpoint"),
    ({"engineExample": {"kind": "tgi"}}, "/engineExample/kind"),
    ({"tls": {"enabled": True, "secret": "x"}}, "additional properties 'secret' not allowed"),
    # gateway.config is checked against the gateway's own config tree.
    ({"gateway": {"config": {"polcy": {"name": "kv_aware"}}}}, "additional properties 'polcy' not allowed"),
    ({"gateway": {"config": {"index": {"max_blocks_per_replica": "lots"}}}}, "/gateway/config/index"),
    ({"gateway": {"config": {"index": {"max_blocks_per_replica": 0}}}}, "/gateway/config/index"),
    ({"gateway": {"config": {"models": [{"block_size": 16}]}}}, "missing property 'name'"),
    ({"gateway": {"config": {"telemetry": {"log_level": "LOUD"}}}}, "/gateway/config/telemetry/log_level"),
    ({"gateway": {"config": {"proxy": {"retries": -1}}}}, "/gateway/config/proxy/retries"),
]


@pytest.mark.parametrize(("values", "named"), BAD_VALUES, ids=[n for _, n in BAD_VALUES])
def test_schema_refuses_bad_values(values: dict[str, Any], named: str) -> None:
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError) as exc:
            chart.validate_schema(values)
        assert named in str(exc.value)
        # Rendering (helm install / helm template) refuses them before any template runs.
        with pytest.raises(helm.HelmValuesError):
            chart.render(values, name="kvgate", namespace="llm")


# (values, words of the chart's own failure message)
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"gateway": {"replicas": 3}}, "3 gateway pods need shared state"),
    ({"autoscaling": {"enabled": True, "maxReplicas": 4}}, "4 gateway pods need shared state"),
    (
        {
            "redis": {"enabled": True},
            "gateway": {"config": {"shared_state": {"redis_url": "redis://r:6379/0"}}},
        },
        "not both",
    ),
    ({"gateway": {"config": {"listen": {"http": "0.0.0.0:9000"}}}}, "set those instead"),
    ({"tls": {"enabled": True}}, "tls.enabled=true needs tls.secretName"),
    (
        {
            "tls": {"enabled": True, "secretName": "t"},
            "gateway": {"config": {"inventory": {"tls_cert": "/x"}}},
        },
        "do not set them too",
    ),
    (
        {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 3}, "redis": {"enabled": True}},
        "autoscaling.minReplicas (5) is above autoscaling.maxReplicas (3)",
    ),
    (
        {
            "metrics": {"serviceMonitor": {"enabled": True}},
            "gateway": {"config": {"telemetry": {"metrics": False}}},
        },
        "no /metrics to scrape",
    ),
    (
        {"gateway": {"terminationGracePeriodSeconds": 30}},
        "must stay below gateway.terminationGracePeriodSeconds (30 s)",
    ),
    (
        {"gateway": {"config": {"server": {"drain_delay_s": 15, "shutdown_grace_s": 45}}}},
        "(60 s) must stay below gateway.terminationGracePeriodSeconds (60 s)",
    ),
    (
        {"gateway": {"config": {"server": {"workers": 3}}, "resources": {"limits": {"cpu": "2"}}}},
        "gateway.config.server.workers (3) is above gateway.resources.limits.cpu (2)",
    ),
    (
        {"gateway": {"config": {"server": {"workers": 3}}, "resources": {"limits": {"cpu": "1500m"}}}},
        "gateway.config.server.workers (3) is above gateway.resources.limits.cpu (1500m)",
    ),
]


@pytest.mark.parametrize(("values", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_chart_fails_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as exc:
        render(values)
    assert message in str(exc.value)


def test_several_gateways_render_with_shared_state() -> None:
    # The refusal above is about shared state, not the pod count.
    for shared in (
        {"redis": {"enabled": True}},
        {"gateway": {"config": {"shared_state": {"redis_url": "redis://redis.infra.svc:6379/3"}}}},
    ):
        values: dict[str, Any] = {"gateway": {"replicas": 3, **shared.get("gateway", {})}}
        values.update({k: v for k, v in shared.items() if k != "gateway"})
        r = render(values)
        assert r.one("Deployment", "kvgate")["spec"]["replicas"] == 3
