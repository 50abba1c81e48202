"""deploy/examples: the gateway configs load through kvgate's config loader, the vLLM Deployment
is valid Kubernetes and carries the chart's agent sidecar, and the quick-start patch turns a plain
vLLM Deployment into it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.config import load_config
from tests.deploy.conftest import EXAMPLES, REPO, containers_named, render

GATEWAY_CONFIGS = sorted(EXAMPLES.glob("gateway-*.yaml"))


def test_there_is_a_config_per_fleet_kind() -> None:
    assert [p.name for p in GATEWAY_CONFIGS] == [
        "gateway-sglang.yaml",
        "gateway-sim.yaml",
        "gateway-vllm.yaml",
    ]


@pytest.mark.parametrize("path", GATEWAY_CONFIGS, ids=[p.name for p in GATEWAY_CONFIGS])
def test_gateway_config_loads(path: Path) -> None:
    config = load_config(path, env={})
    assert config.models, "an example without a model routes nothing"
    assert config.policy.name == "kv_aware"
    for model in config.models:
        assert model.block_size == 16
        if model.tokenizer not in (None, "remote") and not model.tokenizer.startswith("/models/"):
            # Relative paths resolve from the repository root (and from /opt/kvgate in the image).
            assert (REPO / model.tokenizer / "tokenizer.json").is_file(), model.tokenizer


def test_gateway_configs_fit_the_chart() -> None:
    # Each example, minus `listen` (the chart writes it), is accepted as gateway.config by the chart.
    for path in GATEWAY_CONFIGS:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
        tree.pop("listen")
        r = render({"gateway": {"config": tree}})
        assert yaml.safe_load(r.one("ConfigMap", "kvgate")["data"]["config.yaml"])["models"] == tree["models"]


def _load(name: str) -> Any:
    return yaml.safe_load((EXAMPLES / name).read_text(encoding="utf-8"))


def test_vllm_deployment_is_valid_kubernetes() -> None:
    doc = _load("vllm-deployment.yaml")
    for version in ("1.25", kubernetes_validate.utils.latest_version()):
        kubernetes_validate.validate(doc, version, strict=True)


def test_vllm_deployment_matches_the_chart_sidecar() -> None:
    doc = _load("vllm-deployment.yaml")
    containers = {c["name"]: c for c in doc["spec"]["template"]["spec"]["containers"]}
    r = render({"engineExample": {"enabled": True, "kind": "vllm"}})
    (pod, sidecar), *_ = containers_named(r, "kvgate-agent")
    assert containers["kvgate-agent"] == sidecar
    # The vLLM flags kvgate needs are the chart example's, value for value.
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    ours = containers["vllm"]["args"]
    i = engine["args"].index("--kv-events-config")
    j = ours.index("--kv-events-config")
    assert json.loads(ours[j + 1]) == json.loads(engine["args"][i + 1])
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in ours and flag in engine["args"]
    assert containers["vllm"]["command"] == engine["command"]


def _apply_json_patch(doc: Any, patch: list[dict[str, Any]]) -> Any:
    """RFC 6902 ``add`` (the only operation the quick-start patch uses), with ``-`` appending."""
    out = copy.deepcopy(doc)
    for op in patch:
        assert op["op"] == "add", op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = out
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), op["value"])
        else:
            node[last] = op["value"]
    return out


def test_quick_start_patch_gives_the_example_deployment() -> None:
    full = _load("vllm-deployment.yaml")
    patch = _load("vllm-agent-patch.yaml")
    plain = copy.deepcopy(full)
    spec = plain["spec"]["template"]["spec"]
    spec["containers"] = [c for c in spec["containers"] if c["name"] != "kvgate-agent"]
    args = spec["containers"][0]["args"]
    cut = args.index("--enable-prefix-caching")
    spec["containers"][0]["args"] = args[:cut]
    assert "--kv-events-config" not in spec["containers"][0]["args"]
    assert _apply_json_patch(plain, patch) == full


def test_chart_readme_quick_start_names_files_that_exist() -> None:
    readme = (REPO / "deploy/helm/kvgate/README.md").read_text(encoding="utf-8")
    for name in ("chart-values-vllm.yaml", "vllm-agent-patch.yaml", "vllm-deployment.yaml"):
        assert f"deploy/examples/{name}" in readme
        assert (EXAMPLES / name).is_file()
