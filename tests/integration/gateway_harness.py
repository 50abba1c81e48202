"""The gateway integration tests' harness: real processes on loopback: fake backends and the gateway
(``kvgate serve``), each on a port it picks itself (port 0, read back from its first stdout line).

Every process is started in its own session by one ``kvgate_tools.procs.ProcessGroup`` per test and
killed with its whole process group when the test ends, whatever the outcome.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gateway.app_parts import wire_shared_state
from gateway.config import GatewayConfig
from gateway.fleet import Fleet
from gateway.inventory_server import InventoryServer
from gateway.shared_state import SharedState
from kvgate_tools.local_fleet import http as http  # re-exported for the tests
from kvgate_tools.procs import ProcessGroup, read_line
from kvgate_tools.procs import low_free_port as low_free_port  # re-exported for the tests
from kvgate_tools.redis_server import RedisServer as RedisServer  # re-exported for the tests
from router_policies.prefix_index import PrefixIndex

REPO = Path(__file__).resolve().parents[2]
FAKE_BACKEND = Path(__file__).resolve().parent / "fake_backend.py"
TOKENIZER = REPO / "assets" / "tokenizers" / "kvgate-tiny"
ADMIN_TOKEN = "test-admin-token"
AGENT_TOKEN = "test-agent-token"
START_TIMEOUT_S = 30.0


@dataclass
class Backend:
    replica: str
    model: str
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, int]:
        _, _, body = http("GET", self.url + "/stats")
        out: dict[str, int] = json.loads(body)
        return out


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    port: int
    inventory_port: int
    config_path: Path
    stderr_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def admin(self, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
        status, _, raw = http(method, self.url + path, body, {"authorization": f"Bearer {ADMIN_TOKEN}"})
        return status, json.loads(raw) if raw else None

    def replicas(self) -> dict[str, dict[str, Any]]:
        _, doc = self.admin("GET", "/admin/replicas")
        return {r["id"]: r for r in doc["replicas"]}

    def metrics(self) -> str:
        return http("GET", self.url + "/metrics")[2].decode()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


@dataclass
class Procs:
    """The test's fake backends and gateways; their stdout is piped (each prints its port first)."""

    tmp: Path
    group: ProcessGroup = field(init=False)

    def __post_init__(self) -> None:
        self.group = ProcessGroup(self.tmp, cwd=REPO)

    def backend(self, replica: str, model: str = "m", port: int = 0) -> Backend:
        cmd = [sys.executable, str(FAKE_BACKEND), "--id", replica, "--model", model, "--port", str(port)]
        proc = self.group.spawn(f"backend-{replica}", cmd, stdout_pipe=True)
        port = int(read_line(proc, r"fake-backend port=(\d+)", START_TIMEOUT_S).group(1))
        return Backend(replica, model, proc, port)

    def write_config(self, config: Mapping[str, Any], name: str = "gateway.yaml") -> Path:
        path = self.tmp / name
        path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        return path

    def gateway(self, config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Gateway:
        path = self.write_config(config)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        full_env.update({"KVGATE_ADMIN_TOKEN": ADMIN_TOKEN, "KVGATE_AGENT_TOKEN": AGENT_TOKEN})
        name = f"gateway-{len(self.group.started)}"
        cmd = [
            sys.executable, "-m", "gateway.cli", "serve", "--config", str(path),
            "--listen", "127.0.0.1:0", "--inventory", "127.0.0.1:0",
        ]  # fmt: skip
        if not dict(config.get("server") or {}).get("workers"):
            cmd += ["--workers", "1"]  # one process, whose state the tests read, unless set
        proc = self.group.spawn(name, cmd, env=full_env, extra_env=env, stdout_pipe=True)
        m = read_line(proc, r"kvgate serve: http=\S+:(\d+) inventory=\S+:(\d+)", START_TIMEOUT_S)
        return Gateway(proc, int(m.group(1)), int(m.group(2)), path, self.group.log_path(name))


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    with p.group:  # stops every child on the way out
        yield p


def base_config(*backends: Backend, **extra: Any) -> dict[str, Any]:
    models = sorted({b.model for b in backends}) or ["m"]
    cfg: dict[str, Any] = {
        # exact token features (the repository's test tokenizer), as in production
        "models": [{"name": m, "tokenizer": str(TOKENIZER)} for m in models],
        "replicas": [{"id": b.replica, "url": b.url, "models": [b.model]} for b in backends],
        "policy": {"name": "round_robin", "seed": 0},
        "health": {"interval_s": 0.2, "timeout_s": 1.0, "unhealthy_after": 1, "healthy_after": 1},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


@dataclass
class SharedStateInstance:
    """One gateway's shared-state machinery in-process, wired as ``GatewayApp`` wires it."""

    config: GatewayConfig
    index: PrefixIndex
    fleet: Fleet
    registry: CollectorRegistry
    inventory: InventoryServer
    shared: SharedState

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value


def shared_state_instance(
    config: GatewayConfig, name: str, clock: Callable[[], float] = time.monotonic
) -> SharedStateInstance:
    index = PrefixIndex(config.index)
    fleet = Fleet(config, index, clock)
    registry = CollectorRegistry()
    inventory = InventoryServer(index, fleet, token=None, registry=registry)
    shared = wire_shared_state(config, index, fleet, inventory, registry, instance_id=name)
    return SharedStateInstance(config, index, fleet, registry, inventory, shared)
