"""Abusive inventory streams against a real ``kvgate serve`` (docs/faults.md): the table of
``kvgate_tools/faults/abuse_cases.py`` (tests/integration/test_inventory_abuse.py's too: 24 cases, impersonation with
per-replica tokens, a token file, a shared token and registration rules), each over real gRPC.

Must hold: the right status every time, and no replica's index entries, URL or membership changed
(read back through ``/admin/index`` and ``/admin/replicas``); each refusal counted under its reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import yaml

from kvgate_tools.faults.abuse_cases import A0_URL, CASES, TOKENS, bearer
from kvgate_tools.faults.common import Result, Sampler, Tally
from kvgate_tools.procs import ProcessGroup, Ready, free_port
from kvgate_tools.stream_agent import ChannelCaller, hello, run_stream, snap

ADMIN = "faults-admin"
SEED = (("r0", "", [1, 2, 3]), ("r1", "", [11, 12]), ("a0", A0_URL, [21, 22]))


def config(tmp: Path, http_port: int, inv_port: int) -> dict[str, Any]:
    """The abuse table's fleet (its ``rig`` fixture) as a ``kvgate serve`` config."""
    digest = hashlib.sha256(TOKENS["a0"].encode()).hexdigest()
    token_file = tmp / "agents.txt"
    token_file.write_text(f"a0 sha256:{digest}\n")
    return {
        "listen": {"http": f"127.0.0.1:{http_port}", "inventory": f"127.0.0.1:{inv_port}"},
        "models": [{"name": "m", "block_size": 16}],
        "replicas": [
            {"id": "r0", "url": "http://127.0.0.1:9", "models": ["m"]},
            {"id": "r1", "url": "http://127.0.0.1:10", "models": ["m"]},
        ],
        "telemetry": {"access_log": False},
        "server": {"workers": 1},  # the refusal counters are read from one process's /metrics
        "auth": {
            "agent_token_env": "T_SHARED",
            "agent_tokens": {"r0": "T_R0", "r1": "T_R1"},
            "agent_token_file": str(token_file),
            "registration": {"allowed_urls": ["http://10.0.0.*:8000"], "allowed_cidrs": ["192.168.0.0/16"]},
        },
    }


class Admin:
    def __init__(self, base: str) -> None:
        self.base = base

    def get(self, path: str) -> Any:
        req = urllib.request.Request(self.base + path, headers={"authorization": f"Bearer {ADMIN}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return body.decode() if path == "/metrics" else json.loads(body)

    def state(self) -> tuple[dict[str, list[int]], dict[str, str]]:
        reps = self.get("/admin/replicas")["replicas"]
        urls = {r["id"]: r.get("url", "") for r in reps}
        keys = {rid: sorted(self.get(f"/admin/index?replica={rid}")["keys"]) for rid in urls}
        return keys, urls

    def refused(self, reason: str) -> float:
        name = f'kvgate_inventory_streams_refused_total{{reason="{reason}"}}'
        for line in self.get("/metrics").splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0


async def play(inv_port: int, admin: Admin, bad: list[str], tally: Tally) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{inv_port}")
    rig = ChannelCaller(channel)
    try:
        for who, url, keys in SEED:  # the legitimate agents first
            code = await run_stream(rig, bearer(who), [hello(who, url), snap(2, keys)])
            if code != grpc.StatusCode.OK:
                bad.append(f"seeding {who}: {code}")
        for name, token, msgs, want, reason in CASES:
            before, count = admin.state(), admin.refused(reason)
            start = time.monotonic()
            code = await run_stream(rig, token, msgs)
            took = time.monotonic() - start
            changed = admin.state() != before
            counted = admin.refused(reason) == count + 1
            tally.add("clear_error" if code == want and not changed and counted else "broken", took)
            if code != want or changed or not counted:
                bad.append(f"{name}: {code.name} (want {want.name}) changed={changed} counted={counted}")
    finally:
        await channel.close()


def abusive_streams(tmp: Path) -> Result:
    tmp.mkdir(parents=True, exist_ok=True)
    http_port, inv_port = free_port(), free_port()
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(config(tmp, http_port, inv_port)))
    env = {
        "T_SHARED": TOKENS["shared"],
        "T_R0": TOKENS["r0"],
        "T_R1": TOKENS["r1"],
        "KVGATE_ADMIN_TOKEN": ADMIN,
    }
    tally = Tally()
    bad: list[str] = []
    with ProcessGroup(tmp) as group:
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)]
        proc, _ = group.start("gateway", cmd, Ready(url=f"http://127.0.0.1:{http_port}/health"), env)
        admin = Admin(f"http://127.0.0.1:{http_port}")
        with Sampler(proc.pid) as s:
            asyncio.run(play(inv_port, admin, bad, tally))
    notes = f"{len(CASES)} cases from kvgate_tools/faults/abuse_cases.py; " + "; ".join(bad)
    return Result(
        "abusive_inventory_streams", tally, None, s.peak_rss_mb, not bad and tally.sent >= 15, notes
    )
