"""The gateway integration tests' harness: real processes on loopback: fake backends and the gateway
(``kvgate serve``), each on a port it picks itself (port 0, read back from its first stdout line).

Every process is started in its own session and killed with its whole process group when the test
ends, whatever the outcome.
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gateway.app import wire_shared_state
from gateway.config import GatewayConfig
from gateway.fleet import Fleet
from gateway.inventory_server import InventoryServer
from gateway.shared_state import SharedState
from router_policies.prefix_index import PrefixIndex

REPO = Path(__file__).resolve().parents[2]
FAKE_BACKEND = Path(__file__).resolve().parent / "fake_backend.py"
TOKENIZER = REPO / "assets" / "tokenizers" / "kvgate-tiny"
ADMIN_TOKEN = "test-admin-token"
AGENT_TOKEN = "test-agent-token"
START_TIMEOUT_S = 30.0


# Ports for processes that restart at the same address while a client keeps reconnecting to them:
# taken below the kernel's ephemeral range (32768-60999 here), since a TCP connect to a free port
# inside it can be given that port as its source and connect to itself, leaving the port busy for
# the process that comes back. One generator for the whole test process (seeded with the pid so
# that concurrent runs try different ports); each port is checked free by binding it.
_LOW_PORTS = random.Random(os.getpid())


def low_free_port() -> int:
    for _ in range(200):
        port = _LOW_PORTS.randrange(20_000, 32_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in [20000, 32000)")


def read_line(
    proc: subprocess.Popen[bytes], pattern: str, timeout_s: float = START_TIMEOUT_S
) -> re.Match[str]:
    """The first stdout line of ``proc`` matching ``pattern`` (the process's readiness line)."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout_s
    buf = b""
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before printing {pattern!r}: {buf!r}")
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if not ready:
            continue
        chunk = os.read(proc.stdout.fileno(), 4096)
        buf += chunk
        for line in buf.decode(errors="replace").splitlines():
            m = re.search(pattern, line)
            if m:
                return m
    raise TimeoutError(f"no line matching {pattern!r} after {timeout_s}s: {buf!r}")


def kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(grace_s)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


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
    tmp: Path
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def backend(self, replica: str, model: str = "m", port: int = 0) -> Backend:
        proc = subprocess.Popen(
            [sys.executable, str(FAKE_BACKEND), "--id", replica, "--model", model, "--port", str(port)],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self.started.append(proc)
        port = int(read_line(proc, r"fake-backend port=(\d+)").group(1))
        return Backend(replica, model, proc, port)

    def write_config(self, config: Mapping[str, Any], name: str = "gateway.yaml") -> Path:
        path = self.tmp / name
        path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        return path

    def gateway(self, config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Gateway:
        path = self.write_config(config)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        full_env.update({"KVGATE_ADMIN_TOKEN": ADMIN_TOKEN, "KVGATE_AGENT_TOKEN": AGENT_TOKEN})
        full_env.update(env or {})
        stderr_path = self.tmp / f"gateway-{len(self.started)}.err"
        with stderr_path.open("wb") as err:
            proc = subprocess.Popen(
                [
                    sys.executable, "-m", "gateway.cli", "serve", "--config", str(path),
                    "--listen", "127.0.0.1:0", "--inventory", "127.0.0.1:0",
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                env=full_env,
                cwd=REPO,
                start_new_session=True,
            )  # fmt: skip
        self.started.append(proc)
        m = read_line(proc, r"kvgate serve: http=\S+:(\d+) inventory=\S+:(\d+)")
        return Gateway(proc, int(m.group(1)), int(m.group(2)), path, stderr_path)

    def stop_all(self) -> None:
        for proc in reversed(self.started):  # gateways were started after their backends
            kill_group(proc)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


def wait_until(check: Any, timeout_s: float = 15.0, what: str = "condition") -> Any:
    """Poll ``check()`` until it returns a truthy value (state, not speed: the timeout only bounds a
    hang)."""
    end = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"{what} not reached after {timeout_s}s")
        time.sleep(0.05)


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


class RedisServer:
    """A throwaway redis-server on a free loopback port, without persistence; restartable on the
    same port (the gateways reconnect to the address they were given)."""

    def __init__(self, tmp: Path, extra: tuple[str, ...] = ()) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (apt-get install -y redis-server; CI does)")
        self.exe = exe
        self.port = low_free_port()
        self.tmp = tmp
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.proc = subprocess.Popen(
            [
                self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.tmp), *self.extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        wait_until(self.ping, 15.0, "redis-server accepting connections")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None


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


def shared_state_instance(config: GatewayConfig, name: str) -> SharedStateInstance:
    index = PrefixIndex(config.index)
    fleet = Fleet(config, index)
    registry = CollectorRegistry()
    inventory = InventoryServer(index, fleet, token=None, registry=registry)
    shared = wire_shared_state(config, index, fleet, inventory, registry, instance_id=name)
    return SharedStateInstance(config, index, fleet, registry, inventory, shared)
