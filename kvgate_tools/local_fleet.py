"""A whole kvgate deployment on loopback, as real processes: simulated engines, one agent beside
each, and the gateway. Used by ``kvgate demo``, integration tests and live benchmarks.

Ownership and shutdown order: the ``LocalFleet`` owns every process it starts, through one
``kvgate_tools.procs.ProcessGroup`` (each child in its own process group). ``stop()`` ends the
gateway first (no new traffic), then the agents, then the engines, each with SIGTERM and a grace
period before SIGKILL, and it runs on every exit path of the ``with`` block (docs/architecture.md).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kvgate_tools.procs import REPO_ROOT, LowPorts, ProcessGroup, Ready, free_port

__all__ = ["EngineSpec", "FleetOptions", "LocalFleet", "free_port", "http_json", "http_text"]

DEFAULT_TOKENIZER = REPO_ROOT / "assets" / "tokenizers" / "kvgate-tiny"


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of one request; an HTTP error status is an
    answer like any other."""
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def http_json(
    url: str, body: Any = None, timeout: float = 5.0, headers: Mapping[str, str] | None = None
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def http_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text: str = resp.read().decode()
        return text


@dataclass(frozen=True)
class EngineSpec:
    replica_id: str
    http_port: int
    events_port: int
    replay_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@dataclass
class FleetOptions:
    replicas: int = 4
    model: str = "kvgate-tiny"
    block_size: int = 16
    cache_blocks: int = 2048
    profile: str | None = None
    time_scale: float | None = None
    policy: str = "kv_aware"
    policy_params: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    tokenizer: Path = DEFAULT_TOKENIZER
    agents: bool = True
    agent_token: str = "demo-agent-token"
    admin_token: str = "demo-admin-token"
    extra_config: dict[str, Any] = field(default_factory=dict)
    engine_args: dict[str, list[str]] = field(default_factory=dict)  # replica id -> extra sim-engine flags
    log_dir: Path | None = None
    python: str = sys.executable


class LocalFleet:
    def __init__(self, opts: FleetOptions) -> None:
        self.opts = opts
        # every port drawn before any process binds one: none drawn twice, none from the ephemeral
        # range that the fleet's own outgoing connections draw from (the choice is not a result:
        # not seeded by the run's seed)
        ports = LowPorts(random.Random(os.getpid()))
        self.engines = [
            EngineSpec(f"r{i}", ports.take(), ports.take(), ports.take()) for i in range(opts.replicas)
        ]
        self.gateway_port = ports.take()
        self.inventory_port = ports.take()
        self._tmp = tempfile.TemporaryDirectory(prefix="kvgate-fleet-")
        self.workdir = Path(self._tmp.name)
        self.log_dir = opts.log_dir or self.workdir
        self._group = ProcessGroup(self.log_dir)
        self._engines: list[subprocess.Popen[bytes]] = []
        self._agents: list[subprocess.Popen[bytes]] = []
        self._gateway: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------ config
    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.opts.admin_token}"}

    def gateway_config(self) -> dict[str, Any]:
        o = self.opts
        cfg: dict[str, Any] = {
            "listen": {
                "http": f"127.0.0.1:{self.gateway_port}",
                "inventory": f"127.0.0.1:{self.inventory_port}",
            },
            "policy": {"name": o.policy, "seed": o.seed, o.policy: dict(o.policy_params)},
            "models": [{"name": o.model, "tokenizer": str(o.tokenizer), "block_size": o.block_size}],
            "replicas": [{"id": e.replica_id, "url": e.url, "models": [o.model]} for e in self.engines],
            "health": {"interval_s": 0.5, "timeout_s": 1.0},
            "telemetry": {"access_log": False},
            # one process: the demo, the what-if demo and the fault scenarios read one process's
            # audit and admin views (with --workers each worker answers for itself)
            "server": {"workers": 1},
        }
        for key, value in o.extra_config.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        return cfg

    def _spawn(self, name: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
        env = {
            "KVGATE_AGENT_TOKEN": self.opts.agent_token,
            "KVGATE_ADMIN_TOKEN": self.opts.admin_token,
            "PYTHONUNBUFFERED": "1",
        }
        return self._group.spawn(name, [self.opts.python, "-m", "gateway.cli", *args], extra_env=env)

    def _wait_http(self, name: str, proc: subprocess.Popen[bytes] | None, url: str, timeout_s: float) -> None:
        assert proc is not None
        self._group.wait_ready(name, proc, Ready(url=url, timeout_s=timeout_s))

    # ------------------------------------------------------------------ lifecycle
    def start_engine(self, i: int) -> None:
        o = self.opts
        e = self.engines[i]
        args = [
            "sim-engine",
            "--host", "127.0.0.1",
            "--port", str(e.http_port),
            "--events-port", str(e.events_port),
            "--replay-port", str(e.replay_port),
            "--model", o.model,
            "--cache-blocks", str(o.cache_blocks),
            "--block-size", str(o.block_size),
            "--tokenizer", str(o.tokenizer),
            "--seed", str(o.seed + i),
        ]  # fmt: skip
        if o.profile:
            args += ["--profile", o.profile]
        if o.time_scale is not None:
            args += ["--time-scale", str(o.time_scale)]
        args += o.engine_args.get(e.replica_id, [])
        proc = self._spawn(f"engine-{e.replica_id}", args)
        if i < len(self._engines):
            self._engines[i] = proc
        else:
            self._engines.append(proc)

    def start_agent(self, i: int, events_url: str | None = None) -> None:
        """Start replica ``i``'s agent; ``events_url`` replaces the engine's event endpoint (a relay)."""
        e = self.engines[i]
        args = [
            "agent",
            "--replica-id", e.replica_id,
            "--engine-url", e.url,
            "--events", events_url or f"tcp://127.0.0.1:{e.events_port}",
            "--replay", f"tcp://127.0.0.1:{e.replay_port}",
            "--gateway", f"127.0.0.1:{self.inventory_port}",
            "--token-env", "KVGATE_AGENT_TOKEN",
        ]  # fmt: skip
        proc = self._spawn(f"agent-{e.replica_id}", args)
        if i < len(self._agents):
            self._agents[i] = proc
        else:
            self._agents.append(proc)

    def start_gateway(self) -> None:
        path = self.workdir / "gateway.yaml"
        path.write_text(yaml.safe_dump(self.gateway_config(), sort_keys=False))
        self._gateway = self._spawn("gateway", ["serve", "--config", str(path)])

    def start(self, ready_timeout_s: float = 60.0) -> LocalFleet:
        for i in range(len(self.engines)):
            self.start_engine(i)
        self.start_gateway()
        for i, e in enumerate(self.engines):
            self._wait_http(f"engine-{e.replica_id}", self._engines[i], f"{e.url}/health", ready_timeout_s)
        if self.opts.agents:
            for i in range(len(self.engines)):
                self.start_agent(i)
        self._wait_http("gateway", self._gateway, f"{self.gateway_url}/ready", ready_timeout_s)
        if self.opts.agents:
            self.wait_agents_connected(ready_timeout_s)
        return self

    def wait_agents_connected(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        want = {e.replica_id for e in self.engines}
        while time.monotonic() < end:
            try:
                reps = self.replicas()
            except (urllib.error.URLError, OSError):
                reps = []
            connected = {r.get("id") for r in reps if r.get("agent_connected")}
            if want <= connected:
                return
            time.sleep(0.1)
        raise TimeoutError(f"agents not connected after {timeout_s:.0f}s")

    def replicas(self) -> list[dict[str, Any]]:
        data = http_json(f"{self.gateway_url}/admin/replicas", headers=self.admin_headers)
        reps = data.get("replicas", data) if isinstance(data, dict) else data
        return list(reps)

    def engine_proc(self, i: int) -> subprocess.Popen[bytes]:
        return self._engines[i]

    def agent_proc(self, i: int) -> subprocess.Popen[bytes]:
        return self._agents[i]

    def gateway_proc(self) -> subprocess.Popen[bytes]:
        assert self._gateway is not None
        return self._gateway

    def stop_process(self, proc: subprocess.Popen[bytes] | None, grace_s: float = 5.0) -> None:
        if proc is not None:
            self._group.stop(proc, grace_s)

    def stop(self) -> None:
        self.stop_process(self._gateway)
        for p in [*self._agents, *self._engines]:
            self.stop_process(p)
        self._group.stop_all(grace_s=5.0)

    def __enter__(self) -> LocalFleet:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._tmp.cleanup()

    def engine_metrics(self, i: int) -> str:
        return http_text(f"{self.engines[i].url}/metrics")
