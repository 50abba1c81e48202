"""kvgate in the live bench (bench/live.py; docs/architecture.md, section 11): ``kvgate serve``
with kv_aware in front of the simulated engines, one ``kvgate agent`` per engine, and the wait
until every agent's stream is up before the replay starts.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from bench.live_workloads import TOKENIZER
from kvgate_tools.procs import ProcessGroup, Ready

MODEL = "sim"


def wait_agents(gateway: str, n: int, timeout_s: float = 30.0) -> None:
    """Until every agent's stream is up (``/admin/replicas``: ``n`` replicas with
    ``agent_connected``), so that no agent is still starting (its imports take about half a
    CPU-second each) while the replay runs; raises ``TimeoutError`` after ``timeout_s``.

    Not the ``kvgate_inventory_streams`` gauge by prefix: the lines of
    ``kvgate_inventory_streams_refused_created`` (a Unix time per refusal reason) share it, and
    their sum let the replay start before any agent had started (the first ~2 s of every kvgate
    run then shared the two cores with four starting agents)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{gateway}/admin/replicas", timeout=2) as r:
                data = json.loads(r.read())
        except (OSError, ValueError):
            data = []
        reps = data.get("replicas", data) if isinstance(data, dict) else data
        if sum(1 for rep in reps if isinstance(rep, dict) and rep.get("agent_connected")) >= n:
            return
        time.sleep(0.1)
    raise TimeoutError(f"live: {n} agents not connected to kvgate after {timeout_s:.0f} s")


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` laid on it, mappings merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def start_kvgate(
    procs: ProcessGroup, urls: list[str], tmp: Path, params: dict[str, Any], overrides: dict[str, Any]
) -> tuple[str, str]:
    """``kvgate serve`` with kv_aware (``params``) in front of ``urls``, its config's other
    settings as given in ``overrides`` (``--kvgate-config``): (http, inventory) addresses."""
    cfg: dict[str, Any] = {
        "listen": {"http": "127.0.0.1:0", "inventory": "127.0.0.1:0"},
        "policy": {"name": "kv_aware", "kv_aware": params},
        "models": [{"name": MODEL, "tokenizer": str(TOKENIZER), "block_size": 16}],
        "replicas": [{"id": f"r{i}", "url": u, "models": [MODEL]} for i, u in enumerate(urls)],
        "telemetry": {"access_log": False, "log_level": "WARNING"},
        "server": {"workers": 1},  # the audit and TTFT figures are read from one process
    }
    path = tmp / "kvgate.yaml"
    path.write_text(yaml.safe_dump(merged(cfg, overrides)))
    _, m = procs.start(
        "kvgate",
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
        Ready(pattern=r"kvgate serve: http=([\d.]+:\d+) inventory=([\d.]+:\d+)"),
    )
    assert m is not None
    return m.group(1), m.group(2)


def start_agents(procs: ProcessGroup, fleet: list[tuple[str, str, str]], inventory: str) -> None:
    """One ``kvgate agent`` per engine of ``fleet``, streaming to kvgate's ``inventory`` address."""
    for i, (u, ev, replay_ep) in enumerate(fleet):
        procs.spawn(
            f"agent{i}",
            [
                sys.executable, "-m", "gateway.cli", "agent", "--replica-id", f"r{i}", "--engine-url", u,
                "--events", ev, "--replay", replay_ep, "--gateway", inventory, "--model", MODEL,
                "--log-level", "WARNING",
            ],
        )  # fmt: skip
