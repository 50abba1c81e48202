"""The chart rendered by Helm's own engine, for the default values and every values file: each
manifest valid against the Kubernetes schemas, the ConfigMap's config.yaml accepted by kvgate's own
config loader, and the pods' command lines accepted by kvgate's own CLI parsers."""

from __future__ import annotations

import argparse
import base64
import json
import re
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate
import pytest
import yaml

from gateway import serve_cli
from gateway.config import load_config
from replica_agent import agent_cli, sim_engine_cli
from tests.deploy.conftest import (
    CASES,
    NAMESPACE,
    RELEASE,
    Rendered,
    containers_named,
    gateway_container,
    render,
)

CASE_IDS = [c for c, _ in CASES]
# The oldest Kubernetes the chart admits (Chart.yaml kubeVersion) and the newest the validator knows.
KUBE_VERSIONS = ["1.25", kubernetes_validate.utils.latest_version()]
SERVICE_MONITOR_SCHEMA = json.loads(
    (Path(__file__).parent / "servicemonitor.schema.json").read_text(encoding="utf-8")
)


def test_chart_kube_version_floor_is_what_we_validate() -> None:
    chart = yaml.safe_load((Path(__file__).parents[2] / "deploy/helm/kvgate/Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.25.0-0"


@pytest.mark.parametrize("case", CASE_IDS)
def test_every_manifest_is_valid_kubernetes(case: str, rendered_cases: dict[str, Rendered]) -> None:
    r = rendered_cases[case]
    assert r.docs, "nothing rendered"
    for doc in r.docs:
        where = f"{case}: {doc['kind']}/{doc['metadata']['name']}"
        assert doc["metadata"].get("namespace") == NAMESPACE, where
        if doc["kind"] == "ServiceMonitor":
            # A CRD: kubernetes-validate ships only the built-in kinds, so check it against the
            # Prometheus Operator's ServiceMonitor fields the chart uses (strict on unknown keys).
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)
            jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{where} invalid for Kubernetes {version}: {path}: {exc.message}")


def test_validation_catches_a_broken_manifest(rendered_cases: dict[str, Rendered]) -> None:
    # The validator in use refuses what Kubernetes would: a typo'd field and a wrong type.
    deploy = json.loads(json.dumps(rendered_cases["defaults"].one("Deployment", RELEASE)))
    deploy["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, KUBE_VERSIONS[-1], strict=True)
    deploy = json.loads(json.dumps(rendered_cases["defaults"].one("Deployment", RELEASE)))
    deploy["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, KUBE_VERSIONS[-1], strict=True)


# ---- the gateway's config.yaml


def _secret_values(r: Rendered) -> dict[tuple[str, str], str]:
    out: dict[tuple[str, str], str] = {}
    for s in r.of_kind("Secret"):
        for key, b64 in (s.get("data") or {}).items():
            out[(s["metadata"]["name"], key)] = base64.b64decode(b64).decode()
    return out


def container_env(
    r: Rendered, container: dict[str, Any], existing: dict[tuple[str, str], str]
) -> dict[str, str]:
    """The container's environment as Kubernetes would set it: literal values with ``$(VAR)``
    expanded from earlier variables, Secret references resolved from the rendered Secrets (or
    ``existing`` for Secrets the user provides), field references as placeholders."""
    secrets = {**existing, **_secret_values(r)}
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), e["value"]
            )
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) in secrets, (
                f"{e['name']}: no Secret {ref['name']} key {ref['key']}"
            )
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
        else:
            env[e["name"]] = f"<{e['name']}>"
    return env


def _existing_secrets(values: dict[str, Any]) -> dict[tuple[str, str], str]:
    # Secrets a values file names but the chart does not create: stand-ins for the user's.
    auth = values.get("auth", {})
    out: dict[tuple[str, str], str] = {}
    if auth.get("existingSecret"):
        out[(auth["existingSecret"], auth.get("agentTokenKey", "agent-token"))] = "user-agent-token"
        out[(auth["existingSecret"], auth.get("adminTokenKey", "admin-token"))] = "user-admin-token"
    return out


@pytest.mark.parametrize(("case", "values"), CASES, ids=CASE_IDS)
def test_configmap_config_loads_in_kvgate(
    case: str, values: dict[str, Any], rendered_cases: dict[str, Rendered], tmp_path: Path
) -> None:
    r = rendered_cases[case]
    cm = r.one("ConfigMap", RELEASE)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(cm["data"]["config.yaml"], encoding="utf-8")
    container = gateway_container(r)
    env = container_env(r, container, _existing_secrets(values))
    config = load_config(config_file, env=env)  # raises ConfigError naming the field path

    # The user's tree reaches the gateway unchanged, apart from what the chart owns.
    user = values.get("gateway", {}).get("config", {})
    if "models" in user:
        assert [m.name for m in config.models] == [m["name"] for m in user["models"]]
    if "replicas" in user:
        assert [x.id for x in config.replicas] == [x["id"] for x in user["replicas"]]

    # listen matches the container ports the Service and probes target.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.listen.http == f"0.0.0.0:{ports['http']}"
    assert config.listen.inventory == f"0.0.0.0:{ports['grpc']}"

    # The token variables the gateway reads are set, from the tokens Secret.
    for var in (config.auth.agent_token_env, config.auth.admin_token_env):
        assert var is not None and env.get(var), f"{var} not set in the gateway container"

    # Shared state: on exactly when the values ask for it, through the loader's env override.
    redis_enabled = values.get("redis", {}).get("enabled", False)
    if redis_enabled:
        password = _secret_values(r)[(f"{RELEASE}-redis", "redis-password")]
        assert len(password) == 32
        assert config.shared_state.redis_url == f"redis://:{password}@{RELEASE}-redis.{NAMESPACE}.svc:6379/0"
        assert password not in cm["data"]["config.yaml"]
    elif not user.get("shared_state", {}).get("redis_url"):
        assert config.shared_state.redis_url is None

    # TLS: the certificate and key the config names are files of the mounted Secret.
    tls = values.get("tls", {})
    if tls.get("enabled"):
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in r.one("Deployment", RELEASE)["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == tls["secretName"]
        files = {f"{mounts['tls']}/{item['path']}": item["key"] for item in volumes["tls"]["secret"]["items"]}
        assert files[str(config.inventory.tls_cert)] == "tls.crt"
        assert files[str(config.inventory.tls_key)] == "tls.key"
    else:
        assert config.inventory.tls_cert is None and config.inventory.tls_key is None


# ---- the gateway pod


def _parse(configure: Any, args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    configure(parser)
    ns: argparse.Namespace = parser.parse_args(args)
    return ns


@pytest.mark.parametrize("case", CASE_IDS)
def test_gateway_pod(case: str, rendered_cases: dict[str, Rendered]) -> None:
    r = rendered_cases[case]
    deploy = r.one("Deployment", RELEASE)
    pod = deploy["spec"]["template"]["spec"]
    c = gateway_container(r)

    assert c["args"][0] == "serve"
    args = _parse(serve_cli.configure, c["args"][1:])
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    config_dir = str(Path(args.config).parent)
    assert mounts[config_dir]["name"] == "config" and mounts[config_dir]["readOnly"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == RELEASE
    assert Path(args.config).name == "config.yaml"

    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}

    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    # A read-only root needs a writable /tmp.
    assert volumes[mounts["/tmp"]["name"]]["emptyDir"]["sizeLimit"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    assert pod["automountServiceAccountToken"] is False

    # The Service reaches the two named container ports; PDB and Service select these pods.
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc = r.one("Service", RELEASE)
    assert svc["spec"]["selector"].items() <= labels.items()
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"http": "http", "grpc": "grpc"}
    assert {p["name"] for p in c["ports"]} == {"http", "grpc"}
    for pdb in r.of_kind("PodDisruptionBudget"):
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for hpa in r.of_kind("HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": RELEASE,
        }
        assert "replicas" not in deploy["spec"], "the autoscaler owns the replica count"
    for sm in r.of_kind("ServiceMonitor"):
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert sm["spec"]["endpoints"][0]["port"] == "http"


@pytest.mark.parametrize("case", CASE_IDS)
def test_gateway_pod_count_needs_shared_state(case: str, rendered_cases: dict[str, Rendered]) -> None:
    # What the chart's check guarantees for every rendered case: several gateway pods only with Redis.
    r = rendered_cases[case]
    deploy = r.one("Deployment", RELEASE)
    hpas = r.of_kind("HorizontalPodAutoscaler")
    most = hpas[0]["spec"]["maxReplicas"] if hpas else deploy["spec"]["replicas"]
    env = {e["name"] for e in gateway_container(r).get("env", [])}
    config = yaml.safe_load(r.one("ConfigMap", RELEASE)["data"]["config.yaml"])
    shared = "KVGATE_SHARED_STATE__REDIS_URL" in env or bool(config.get("shared_state", {}).get("redis_url"))
    assert most == 1 or shared


# ---- the agent sidecar and the example engines


def _expand_fields(arg: str) -> str:
    return arg.replace("$(POD_NAME)", "engine-0").replace("$(POD_IP)", "10.0.0.7")


@pytest.mark.parametrize("case", CASE_IDS)
def test_agent_sidecars(case: str, rendered_cases: dict[str, Rendered]) -> None:
    r = rendered_cases[case]
    sidecars = list(containers_named(r, "kvgate-agent"))
    engine_example = any(d["metadata"]["name"] == f"{RELEASE}-engine" for d in r.of_kind("Deployment"))
    assert bool(sidecars) == engine_example
    for pod, c in sidecars:
        assert c["args"][0] == "agent"
        args = _parse(agent_cli.configure, [_expand_fields(a) for a in c["args"][1:]])
        assert args.replica_id == "engine-0"
        assert args.advertise_url == "http://10.0.0.7:8000"
        assert args.engine_url == "http://127.0.0.1:8000"
        assert args.gateway == f"{RELEASE}.{NAMESPACE}.svc:50051"
        # The token variable the agent reads is set from the key the gateway reads it from.
        env = {e["name"]: e for e in c["env"]}
        ref = env[args.token_env]["valueFrom"]["secretKeyRef"]
        gw_env = {e["name"]: e for e in gateway_container(r)["env"]}
        assert gw_env[args.token_env]["valueFrom"]["secretKeyRef"] == ref
        assert c["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        if args.tls_ca:
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            volumes = {v["name"]: v for v in pod["volumes"]}
            items = volumes[mounts[str(Path(args.tls_ca).parent)]]["secret"]["items"]
            assert {"key": "ca.crt", "path": Path(args.tls_ca).name} in items

        engine = next(x for x in pod["containers"] if x["name"] == "engine")
        events_port = args.events.rsplit(":", 1)[1]
        replay_port = args.replay.rsplit(":", 1)[1]
        if engine["args"][0] == "sim-engine":
            sim = _parse(sim_engine_cli.configure, engine["args"][1:])
            assert (str(sim.port), str(sim.events_port), str(sim.replay_port)) == (
                "8000",
                events_port,
                replay_port,
            )
            assert sim.host == "0.0.0.0"
            assert str(sim.tokenizer) == "/opt/kvgate/assets/tokenizers/kvgate-tiny"
            # The simulated engine has no cache_config_info metric: its agent is told the block size.
            assert args.block_size == sim.block_size
        else:
            engine_args = engine["args"]
            kv = json.loads(engine_args[engine_args.index("--kv-events-config") + 1])
            assert kv == {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events_port}",
                "replay_endpoint": f"tcp://*:{replay_port}",
                "topic": "kv-events",
            }
            assert "--enable-prefix-caching" in engine_args
            # vLLM's agent learns the block size from vLLM's cache_config_info metric.
            assert args.block_size is None
            assert engine_args[engine_args.index("--port") + 1] == "8000"


def test_without_replay_the_engine_publishes_no_replay_socket() -> None:
    r = render({"engineExample": {"enabled": True, "kind": "vllm"}, "agent": {"replayEndpoint": ""}})
    (pod, agent), *_ = containers_named(r, "kvgate-agent")
    assert "--replay" not in agent["args"]
    engine = next(x for x in pod["containers"] if x["name"] == "engine")
    kv = json.loads(engine["args"][engine["args"].index("--kv-events-config") + 1])
    assert "replay_endpoint" not in kv


def test_the_simulated_engines_run_the_sim_build_of_the_image() -> None:
    """The default image has no ``sim`` extra (deploy/docker/Dockerfile): the example's simulated
    engines run the ``-sim`` build, the gateway and the agents the plain one."""
    values: dict[str, Any] = {"image": {"repository": "reg/kvgate", "tag": "1.2"}}
    for sim, want in (({}, "reg/kvgate:1.2-sim"), ({"imageTag": "custom"}, "reg/kvgate:custom")):
        r = render({**values, "engineExample": {"enabled": True, "kind": "sim", "sim": sim}})
        (pod, agent), *_ = containers_named(r, "kvgate-agent")
        engine = next(x for x in pod["containers"] if x["name"] == "engine")
        assert engine["args"][0] == "sim-engine"
        assert engine["image"] == want
        assert agent["image"] == gateway_container(r)["image"] == "reg/kvgate:1.2"


def test_existing_tokens_secret_is_referenced_not_created(rendered_cases: dict[str, Rendered]) -> None:
    r = rendered_cases["one-gateway-values"]
    assert not [s for s in r.of_kind("Secret") if s["metadata"]["name"].endswith("-tokens")]
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in gateway_container(r)["env"] if "valueFrom" in e}
    assert refs == {"kvgate-tokens-prod"}


def test_generated_tokens_are_random_and_distinct(rendered_cases: dict[str, Rendered]) -> None:
    secret = rendered_cases["defaults"].one("Secret", f"{RELEASE}-tokens")
    agent, admin = (base64.b64decode(secret["data"][k]).decode() for k in ("agent-token", "admin-token"))
    assert len(agent) == len(admin) == 48 and agent != admin
    again = render({}).one("Secret", f"{RELEASE}-tokens")
    assert base64.b64decode(again["data"]["agent-token"]).decode() != agent


def test_config_checksum_follows_the_config() -> None:
    def checksum(values: dict[str, Any]) -> str:
        d = render(values).one("Deployment", RELEASE)
        return str(d["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    base = checksum({})
    assert checksum({}) == base
    assert checksum({"gateway": {"config": {"policy": {"name": "round_robin"}}}}) != base
