"""Two ``kvgate serve`` instances sharing one real ``redis-server`` (docs/shared-state.md).

Simulated engines with agents connected to instance A only (``LocalFleet``); instance B is a second
gateway with the same config. After traffic through A, B's index equals A's and the engines'
``/debug/blocks``; B routes a repeated prefix to the replica holding it; A's in-flight load shows
in B's decisions. Killing redis-server: both keep serving, ``kvgate_shared_state_up`` says 0 and a
log line says why; restarting it: state converges again.

A machine without ``redis-server`` on PATH runs the one the dev extra installs (kvgate_tools/redis_server.py).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate_tools.local_fleet import FleetOptions, LocalFleet, http_json, http_text
from kvgate_tools.redis_server import shared_fleet_config
from tests.integration.gateway_harness import Gateway, Procs, RedisServer, http
from tests.polling import wait_until

pytestmark = pytest.mark.timeout(600)

CONVERGE_S = 30.0  # bounds a hang only; the assertions are about state


# ---------------------------------------------------------------------- helpers
PROMPTS = [f"Conversation {i}: " + " ".join(f"word{(i * 7 + j) % 53}" for j in range(120)) for i in range(8)]


def complete(base: str, prompt: str, max_tokens: int = 4, timeout: float = 60.0) -> tuple[int, str, bytes]:
    status, headers, body = http(
        "POST",
        base + "/v1/completions",
        json.dumps({"model": "kvgate-tiny", "prompt": prompt, "max_tokens": max_tokens}).encode(),
        {"content-type": "application/json"},
        timeout=timeout,
    )
    return status, headers.get("x-kvgate-replica", ""), body


def index_keys(base: str, headers: dict[str, str], replica: str) -> list[int] | None:
    status, _, body = http("GET", f"{base}/admin/index?replica={replica}", headers=headers)
    if status == 404:
        return None
    assert status == 200, body
    keys: list[int] = json.loads(body)["keys"]
    return keys


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def explain(base: str, headers: dict[str, str], prompt: str) -> Any:
    return http_json(
        base + "/admin/explain", {"model": "kvgate-tiny", "prompt": prompt}, headers=headers, timeout=30
    )


class Pair:
    """Instance A (LocalFleet's gateway, with the agents) and instance B (same config, no agents)."""

    def __init__(self, fleet: LocalFleet, b: Gateway) -> None:
        self.fleet = fleet
        self.b = b
        self.a_url = fleet.gateway_url
        self.a_headers = fleet.admin_headers
        self.b_headers = {"authorization": "Bearer test-admin-token"}
        self.replicas = [e.replica_id for e in fleet.engines]

    def engine_keys(self, i: int) -> list[int]:
        doc = http_json(self.fleet.engines[i].url + "/debug/blocks")
        return sorted(doc["keys"])

    def converged(self) -> bool:
        for i, rid in enumerate(self.replicas):
            engine = self.engine_keys(i)
            a = index_keys(self.a_url, self.a_headers, rid)
            b = index_keys(self.b.url, self.b_headers, rid)
            if not engine or a != engine or b != engine:
                return False
        return True

    def wait_shared_state_up(self, value: float, what: str) -> None:
        """Until both instances' ``kvgate_shared_state_up`` reads ``value``."""
        for base in (self.a_url, self.b.url):
            wait_until(
                lambda base=base: metric(http_text(base + "/metrics"), "kvgate_shared_state_up") == value,
                CONVERGE_S,
                f"{base} reports shared state {what}",
            )


@pytest.fixture
def pair(redis_server: RedisServer, procs: Procs, tmp_path: Path) -> Iterator[Pair]:
    opts = FleetOptions(
        replicas=2,
        cache_blocks=512,
        policy="kv_aware",
        extra_config=shared_fleet_config(redis_server),
        log_dir=tmp_path,
    )
    with LocalFleet(opts) as fleet:
        b = procs.gateway(fleet.gateway_config())
        wait_until(lambda: http("GET", b.url + "/ready")[0] == 200, CONVERGE_S, "instance B ready")
        yield Pair(fleet, b)


# ---------------------------------------------------------------------- the test
def test_two_gateways_share_index_and_load_and_survive_redis_outage(
    pair: Pair, redis_server: RedisServer
) -> None:
    # --- inventory: traffic through A only; B's index follows A's and the engines'
    landed: dict[str, str] = {}
    for prompt in PROMPTS:
        status, replica, body = complete(pair.a_url, prompt)
        assert status == 200, body
        landed[prompt] = replica
    assert set(landed.values()) <= set(pair.replicas)
    wait_until(pair.converged, CONVERGE_S, "B's index == A's index == engine blocks")
    b_replicas = pair.b.replicas()
    assert all(b_replicas[r]["shared_inventory"] for r in pair.replicas)
    assert all(not b_replicas[r]["agent_connected"] for r in pair.replicas)

    # --- routing on B by A's agents' inventories: a repeated prefix goes where it is cached
    def b_idle() -> bool:
        return all(r["in_flight_requests"] == 0 for r in pair.b.replicas().values())

    for prompt, replica in list(landed.items())[:4]:
        # a request's flight ends just after its last byte: let B's previous one finish, so that
        # the hot-spot guard sees an idle fleet
        wait_until(b_idle, CONVERGE_S, "B idle")
        doc = explain(pair.b.url, pair.b_headers, prompt)
        assert doc["decision"]["replica"] == replica, json.dumps(doc)
        assert doc["decision"]["matched_blocks"] > 0, doc
        status, routed, body = complete(pair.b.url, prompt)
        assert status == 200, body
        assert routed == replica

    # --- load: long requests in flight through A are counted in B's decisions
    n_long = 3
    results: list[int] = []

    def send_long() -> None:
        results.append(complete(pair.a_url, PROMPTS[0] + " long", max_tokens=400, timeout=120)[0])

    threads = [threading.Thread(target=send_long) for _ in range(n_long)]
    for t in threads:
        t.start()
    try:

        def b_sees_a_load() -> bool:
            doc = explain(pair.b.url, pair.b_headers, PROMPTS[1])
            return bool(sum(r["in_flight_requests"] for r in doc["replicas"]) >= n_long)

        wait_until(b_sees_a_load, CONVERGE_S, "A's in-flight requests in B's explain")

        def b_sees_a_sharing() -> bool:
            # the three flights predicted cached on one replica: A's shared tokens, sent beside its load
            doc = explain(pair.b.url, pair.b_headers, PROMPTS[1])
            return any(r["in_flight_shared_tokens"] > 0 for r in doc["replicas"])

        wait_until(b_sees_a_sharing, CONVERGE_S, "A's shared cached tokens in B's explain")
        b_local = pair.b.replicas()
        assert sum(r["in_flight_requests"] for r in b_local.values()) == 0  # none routed by B itself
        assert sum(r["remote_in_flight_requests"] for r in b_local.values()) >= n_long
    finally:
        for t in threads:
            t.join(120)
    assert results == [200] * n_long

    # --- Redis goes away: both keep serving, the metric and a log line say so
    redis_server.stop()
    pair.wait_shared_state_up(0.0, "down")
    for prompt in PROMPTS[:4]:
        for base in (pair.a_url, pair.b.url):
            status, _, body = complete(base, prompt + " during outage")
            assert status == 200, body
    assert "Redis unreachable" in pair.b.stderr()
    # B still routes by what it learned before the outage
    wait_until(b_idle, CONVERGE_S, "B idle")
    doc = explain(pair.b.url, pair.b_headers, PROMPTS[5])
    assert doc["decision"]["replica"] == landed[PROMPTS[5]]

    # --- Redis comes back (empty: no persistence): owners republish, followers resync
    redis_server.start()
    pair.wait_shared_state_up(1.0, "up")
    for prompt in PROMPTS:
        status, _, body = complete(pair.a_url, prompt + " after the outage")
        assert status == 200, body
    wait_until(pair.converged, CONVERGE_S, "convergence after Redis restarted")
