"""Shared helpers of the deploy tests: render the Helm chart with Helm's own Go SDK
(``helm-python-sdk`` binds libhelm_c, Helm v4's SDK behind a C ABI) and read the manifests back.

Nothing here skips: a missing ``helm_python`` or ``kubernetes_validate`` fails collection.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "kvgate"
EXAMPLES = REPO / "deploy" / "examples"
RELEASE = "kvgate"
NAMESPACE = "llm"

# Every values file the chart is rendered with: the chart's ci/ files and the quick-start values.
VALUES_FILES = sorted(CHART.glob("ci/*-values.yaml")) + sorted(EXAMPLES.glob("chart-values-*.yaml"))
# (case id, values) for the default values and each file.
DEFAULT_CASE: tuple[str, dict[str, Any]] = ("defaults", {})
CASES: list[tuple[str, dict[str, Any]]] = [DEFAULT_CASE] + [
    (p.stem, yaml.safe_load(p.read_text(encoding="utf-8"))) for p in VALUES_FILES
]


@dataclass(frozen=True)
class Rendered:
    """The manifests of one render, as parsed documents, with lookups by kind and name."""

    docs: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def kinds(self) -> set[str]:
        return {d["kind"] for d in self.docs}


def render(values: dict[str, Any], *, release: str = RELEASE, namespace: str = NAMESPACE) -> Rendered:
    """Render the chart as ``helm template`` would (schema check included) and parse every manifest."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=release, namespace=namespace, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return Rendered(docs)


def gateway_container(r: Rendered) -> dict[str, Any]:
    deploy = r.one("Deployment", RELEASE)
    containers = deploy["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["gateway"]
    c: dict[str, Any] = containers[0]
    return c


def containers_named(r: Rendered, name: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) for every container called ``name`` in any Deployment."""
    for deploy in r.of_kind("Deployment"):
        spec = deploy["spec"]["template"]["spec"]
        for c in spec["containers"]:
            if c["name"] == name:
                yield spec, c


@pytest.fixture(scope="session")
def rendered_cases() -> dict[str, Rendered]:
    return {case: render(values) for case, values in CASES}
