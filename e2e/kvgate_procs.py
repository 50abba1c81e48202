"""The kvgate processes of the harness: the gateway (``kvgate serve``) and one agent
(``kvgate agent``) per replica, started from the main virtualenv as real processes on loopback.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e import http_client
from e2e.vllm_replica import BLOCK_SIZE, ReplicaSpec, seconds_until_ready
from kvgate_tools.procs import LowPorts, ProcessGroup, Ready

ADMIN_TOKEN = "e2e-admin-token"
AGENT_TOKEN = "e2e-agent-token"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TOKEN_ENV = {"KVGATE_ADMIN_TOKEN": ADMIN_TOKEN, "KVGATE_AGENT_TOKEN": AGENT_TOKEN, "PYTHONUNBUFFERED": "1"}


def kvgate_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", *args]


@dataclass
class Gateway:
    """One gateway process; ``start`` writes its YAML config and waits for ``/ready``."""

    procs: ProcessGroup
    workdir: Path
    model: str
    tokenizer: Path
    replicas: Sequence[tuple[str, ReplicaSpec]]
    ports: LowPorts
    http_port: int = 0
    inventory_port: int = 0
    url: str = field(init=False)  # http://127.0.0.1:<http_port>
    inventory: str = field(init=False)  # 127.0.0.1:<inventory_port>, where agents connect
    proc: subprocess.Popen[bytes] | None = None
    name: str = ""  # the running process's log name
    starts: int = 0
    model_extra: dict[str, Any] = field(default_factory=dict)  # more of models[0] (lora_adapters)

    def __post_init__(self) -> None:
        # Fixed for the gateway's lifetime across restarts, so agents reconnect to the same port.
        self.http_port = self.ports.take()
        self.inventory_port = self.ports.take()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.inventory = f"127.0.0.1:{self.inventory_port}"

    def config(self, policy: str) -> dict[str, Any]:
        return {
            "listen": {"http": f"127.0.0.1:{self.http_port}", "inventory": self.inventory},
            "policy": {"name": policy, "seed": 0},
            "models": [
                {"name": self.model, "tokenizer": str(self.tokenizer), "block_size": BLOCK_SIZE}
                | self.model_extra
            ],
            "replicas": [{"id": rid, "url": spec.url, "models": [self.model]} for rid, spec in self.replicas],
            # A fast health period bounds how long after a restart the replica is used again; the
            # generous timeout keeps a busy replica on a loaded 2-core machine from being ejected.
            "health": {"interval_s": 0.5, "timeout_s": 2.0, "unhealthy_after": 2, "healthy_after": 1},
            "proxy": {"retries": 2, "connect_timeout_s": 1.0, "request_timeout_s": 120.0},
            "telemetry": {"access_log": True},
            # one process: the checks read one process's metrics, admin views and access log
            "server": {"workers": 1},
        }

    def start(self, policy: str) -> float:
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / f"gateway-{policy}.yaml"
        path.write_text(yaml.safe_dump(self.config(policy), sort_keys=False))
        self.starts += 1
        self.name = f"gateway-{self.starts}-{policy}"
        self.proc = self.procs.spawn(
            self.name, kvgate_argv("serve", "--config", str(path)), extra_env=TOKEN_ENV
        )
        return seconds_until_ready(
            self.procs, self.name, self.proc, Ready(url=self.url + "/ready", timeout_s=60.0)
        )

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc)
            self.proc = None

    def replicas_state(self) -> dict[str, dict[str, Any]]:
        doc = http_client.get(self.url + "/admin/replicas", ADMIN_HEADERS).json()
        return {r["id"]: r for r in doc["replicas"]}

    def index_keys(self, rid: str) -> set[int] | None:
        """The replica's precise keys in the gateway's index (None if it does not know the id)."""
        resp = http_client.get(f"{self.url}/admin/index?replica={rid}", ADMIN_HEADERS)
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise RuntimeError(f"/admin/index?replica={rid}: HTTP {resp.status}: {resp.body[:200]!r}")
        return {int(k) for k in resp.json()["keys"]}

    def wait_agents(self, ids: Sequence[str], deadline_s: float = 60.0) -> float:
        t0 = time.monotonic()
        while True:
            try:
                state = self.replicas_state()
            except (OSError, ValueError, KeyError):
                state = {}
            if all(state.get(i, {}).get("agent_connected") for i in ids):
                return time.monotonic() - t0
            if time.monotonic() - t0 > deadline_s:
                raise RuntimeError(f"agents {list(ids)} not connected after {deadline_s:.0f} s: {state}")
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{self.procs.tail(self.name)}")
            time.sleep(0.1)


def start_agent(
    procs: ProcessGroup, rid: str, spec: ReplicaSpec, model: str, gateway: Gateway, *extra: str
) -> subprocess.Popen[bytes]:
    argv = kvgate_argv(
        "agent",
        "--replica-id",
        rid,
        "--engine-url",
        spec.url,
        "--events",
        spec.events_endpoint,
        "--replay",
        spec.replay_endpoint,
        "--gateway",
        gateway.inventory,
        "--model",
        model,
        "--block-size",
        str(BLOCK_SIZE),
        "--load-interval",
        "0.5",
        *extra,
    )
    return procs.spawn(f"agent-{rid}", argv, extra_env=TOKEN_ENV)
