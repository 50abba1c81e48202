"""The chart's simulated fleet, run for real on loopback: the gateway, the simulated engine and the
agent sidecar each started from the container the chart renders (its arguments, its environment
with the tokens Secret resolved, its config.yaml), so the sidecar's wiring (replica id, advertised
URL, events and replay endpoints, token variable) is proven against the real processes.

What differs from a pod, and why: ports are free ports instead of 8000/5557/5558/50051 (the chart
renders them from values, so the test sets those values); every socket binds 127.0.0.1 instead of
0.0.0.0 (tests stay on loopback); the agent reaches the gateway at 127.0.0.1 instead of the
Service's DNS name (agent.gatewayAddress); the image's /opt/kvgate is this checkout."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate_tools.procs import stop_group
from tests.deploy.conftest import CHART, RELEASE, REPO, containers_named, gateway_container, render
from tests.deploy.test_chart_render import container_env

POD_NAME = f"{RELEASE}-engine-0"
IMAGE_ROOT = "/opt/kvgate"  # the image's WORKDIR, where the checkout's files live in the image


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _from_image(arg: str) -> str:
    return arg.replace(IMAGE_ROOT, str(REPO)).replace("0.0.0.0", "127.0.0.1")


def _http(
    method: str, url: str, body: Any = None, token: str | None = None
) -> tuple[int, dict[str, str], Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status), dict(resp.headers), json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return int(exc.code), dict(exc.headers), json.loads(exc.read() or b"null")


@dataclass
class Fleet:
    gateway: str
    engine: str
    admin_token: str


def _start(
    stack: ExitStack, name: str, cmd: list[str], env: dict[str, str], logs: Path, ready: str
) -> subprocess.Popen[str]:
    """Start a process, end it when the stack closes, and wait for its ready line on stdout."""
    bindir = str(Path(sys.executable).parent)
    log = logs / f"{name}.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            cmd,
            env={"PATH": bindir, "HOME": str(logs), **env},
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,  # its own process group, which stop_group ends
        )
    stack.callback(stop_group, proc, grace_s=15.0)
    if ready:
        assert proc.stdout is not None
        seen = []
        for _ in range(50):  # the ready line, after at most a few lines of other output
            line = proc.stdout.readline()
            seen.append(line)
            if not line or line.startswith(ready):
                break
        if not line.startswith(ready):
            proc.kill()
            proc.wait(timeout=15)
            pytest.fail(f"{name} did not start: stdout {seen!r}\nstderr {log.read_text()[-3000:]}")
    return proc


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    http, inventory, engine, events, replay = (_free_port() for _ in range(5))
    values = yaml.safe_load((CHART / "ci" / "sim-fleet-values.yaml").read_text(encoding="utf-8"))
    values["engineExample"]["replicas"] = 1
    values["gateway"]["ports"] = {"http": http, "inventory": inventory}
    values["agent"] = {
        "enginePort": engine,
        "eventsEndpoint": f"tcp://127.0.0.1:{events}",
        "replayEndpoint": f"tcp://127.0.0.1:{replay}",
        "gatewayAddress": f"127.0.0.1:{inventory}",
    }
    r = render(values)
    kvgate = shutil.which("kvgate", path=str(Path(sys.executable).parent))
    assert kvgate, "the kvgate console script is not installed beside this Python"

    gw = gateway_container(r)
    config_path = gw["args"][gw["args"].index("--config") + 1]
    local_config = tmp_path / "config.yaml"
    local_config.write_text(_from_image(r.one("ConfigMap", RELEASE)["data"]["config.yaml"]), encoding="utf-8")
    gw_env = container_env(r, gw, {})
    gw_args = [str(local_config) if a == config_path else a for a in gw["args"]]
    listen = ["--listen", f"127.0.0.1:{http}", "--inventory", f"127.0.0.1:{inventory}"]

    (pod, agent), *_ = containers_named(r, "kvgate-agent")
    engine_c = next(c for c in pod["containers"] if c["name"] == "engine")
    agent_env = {**container_env(r, agent, {}), "POD_NAME": POD_NAME, "POD_IP": "127.0.0.1"}
    # Kubernetes expands $(VAR) in args from the container's environment.
    agent_args = [re.sub(r"\$\((\w+)\)", lambda m: agent_env[m[1]], a) for a in agent["args"]]

    with ExitStack() as stack:
        _start(stack, "gateway", [kvgate, *gw_args, *listen], gw_env, tmp_path, "kvgate serve: http=")
        _start(
            stack,
            "engine",
            [kvgate, *map(_from_image, engine_c["args"])],
            {},
            tmp_path,
            "sim-engine ready",
        )
        _start(stack, "agent", [kvgate, *agent_args], agent_env, tmp_path, "")
        admin = gw_env[str(yaml.safe_load(local_config.read_text())["auth"]["admin_token_env"])]
        yield Fleet(f"http://127.0.0.1:{http}", f"http://127.0.0.1:{engine}", admin)


def _poll(check: Any, what: str, attempts: int = 150) -> Any:
    """Retry ``check`` (bounded: ``attempts`` x 0.1 s) until it returns something truthy."""
    for _ in range(attempts):
        got = check()
        if got:
            return got
        time.sleep(0.1)
    pytest.fail(f"gave up waiting for {what}: last {check.__name__}() gave {got!r}")


@pytest.mark.timeout(180)
def test_chart_sidecar_registers_and_the_gateway_routes_by_its_inventory(fleet: Fleet) -> None:
    def registered() -> dict[str, Any] | None:
        status, _, body = _http("GET", fleet.gateway + "/admin/replicas", token=fleet.admin_token)
        assert status == 200, body
        mine = [x for x in body["replicas"] if x["id"] == POD_NAME]
        return mine[0] if mine and mine[0].get("healthy") else None

    replica = _poll(registered, f"{POD_NAME} to register through its agent")
    assert json.dumps(replica).count(f"127.0.0.1:{fleet.engine.rsplit(':', 1)[1]}") >= 1  # advertised URL
    assert _poll(lambda: _http("GET", fleet.gateway + "/ready")[0] == 200, "/ready")

    # A request through the gateway lands on the engine pod and fills its cache; the agent's
    # events then give the gateway the engine's exact inventory.
    prompt = {"role": "system", "content": "You are a careful assistant. " * 40}
    body = {"model": "kvgate-tiny", "messages": [prompt, {"role": "user", "content": "hi"}], "max_tokens": 4}
    status, headers, resp = _http("POST", fleet.gateway + "/v1/chat/completions", body)
    assert status == 200, resp
    assert {k.lower(): v for k, v in headers.items()}["x-kvgate-replica"] == POD_NAME

    def same_inventory() -> bool:
        _, _, engine_blocks = _http("GET", fleet.engine + "/debug/blocks")
        status, _, index = _http(
            "GET", fleet.gateway + f"/admin/index?replica={POD_NAME}", token=fleet.admin_token
        )
        return (
            status == 200
            and bool(engine_blocks["keys"])
            and sorted(index["keys"]) == sorted(engine_blocks["keys"])
        )

    assert _poll(same_inventory, "the gateway's index to equal the engine's blocks")
