"""Abusive inventory streams over real gRPC on loopback, against the real fleet with per-replica
agent credentials and registration rules (docs/gateway.md, "Agent credentials").

Every case opens a stream, sends what an attacker or a broken agent would, and checks the status
it gets and that no replica's index entries, URL or membership in the fleet changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
from prometheus_client import CollectorRegistry

from gateway.agent_credentials import stream_access_of
from gateway.config import parse_config
from gateway.fleet import Fleet
from gateway.inventory_server import InventoryServer
from kvgate_tools.faults.abuse_cases import A0_URL, CASES, TOKENS, bearer
from kvgate_tools.stream_agent import (
    authorization,
    events,
    hello,
    run_stream,
    snap,
    status_after_reading,
    stored,
    sync_call,
)
from proto.kvgate.v1 import inventory_pb2 as pb
from replica_agent.gateway_client import GatewayClient, HelloInfo, Link, Sources
from replica_agent.inventory import AgentInventory
from replica_agent.outbox import Outbox
from router_policies.prefix_index import IndexConfig, PrefixIndex

State = tuple[dict[str, list[int]], dict[str, str]]


@dataclass
class Rig:
    server: InventoryServer
    fleet: Fleet
    index: PrefixIndex
    registry: CollectorRegistry
    channel: grpc.aio.Channel
    port: int

    def call(self, token: str | None) -> grpc.aio.StreamStreamCall:
        return sync_call(self.channel, authorization(token))

    def state(self) -> State:
        """Every replica's precise keys and URL (the fleet's membership is the URL map's keys)."""
        keys = {r: sorted(self.index.precise_keys(r)) for r in self.index.replicas}
        return keys, {rec.id: rec.identity.url for rec in self.fleet.records()}


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    """Static r0, r1 (their own tokens from env vars), agent-registered a0 (its token's hash in a
    file), a shared token, registration allowed at http://10.0.0.*:8000 and in 192.168.0.0/16."""
    token_file = tmp_path / "agents.txt"
    digest = hashlib.sha256(TOKENS["a0"].encode()).hexdigest()
    token_file.write_text(f"# replica sha256(token)\na0 sha256:{digest}\n")
    config = parse_config(
        {
            "models": [{"name": "m", "block_size": 16}],
            "replicas": [
                {"id": "r0", "url": "http://127.0.0.1:9", "models": ["m"]},
                {"id": "r1", "url": "http://127.0.0.1:10", "models": ["m"]},
            ],
            "auth": {
                "agent_token_env": "T_SHARED",
                "agent_tokens": {"r0": "T_R0", "r1": "T_R1"},
                "agent_token_file": str(token_file),
                "registration": {
                    "allowed_urls": ["http://10.0.0.*:8000"],
                    "allowed_cidrs": ["192.168.0.0/16"],
                },
            },
        }
    )
    env = {"T_SHARED": TOKENS["shared"], "T_R0": TOKENS["r0"], "T_R1": TOKENS["r1"]}
    index = PrefixIndex(IndexConfig(max_blocks_per_replica=5000))
    fleet = Fleet(config, index)
    registry = CollectorRegistry()
    access = stream_access_of(config, env, lambda: {r.id for r in config.replicas})
    server = InventoryServer(index, fleet, token=None, access=access, registry=registry)
    port = await server.start("127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    r = Rig(server, fleet, index, registry, channel, port)
    try:
        # the legitimate agents first: each replica holds its own blocks
        for who, url, keys in (("r0", "", [1, 2, 3]), ("r1", "", [11, 12]), ("a0", A0_URL, [21, 22])):
            assert await run_stream(r, bearer(who), [hello(who, url), snap(2, keys)]) == grpc.StatusCode.OK
        assert r.state() == (
            {"r0": [1, 2, 3], "r1": [11, 12], "a0": [21, 22]},
            {"r0": "http://127.0.0.1:9", "r1": "http://127.0.0.1:10", "a0": A0_URL},
        )
        yield r
    finally:
        await channel.close()
        await server.stop(0)


@pytest.mark.parametrize(("name", "token", "msgs", "code", "reason"), CASES, ids=[c[0] for c in CASES])
async def test_abusive_stream_is_refused_and_changes_nothing(
    rig: Rig,
    name: str,
    token: str | None,
    msgs: list[pb.AgentMessage | bytes],
    code: grpc.StatusCode,
    reason: str,
) -> None:
    before = rig.state()
    assert await run_stream(rig, token, msgs) == code, name
    assert rig.state() == before, name
    metric = "kvgate_inventory_streams_refused_total"
    assert rig.registry.get_sample_value(metric, {"reason": reason}) == 1.0, name


async def test_own_token_cannot_move_a_configured_replica(rig: Rig) -> None:
    """r0's own agent may say Hello with another URL: accepted, but r0 keeps its configured URL."""
    before = rig.state()
    assert (
        await run_stream(rig, bearer("r0"), [hello("r0", "http://evil.example:8000")]) == grpc.StatusCode.OK
    )
    assert rig.state() == before


async def test_registration_within_the_rules(rig: Rig) -> None:
    """The shared token registers a replica without a token of its own at an allowed URL; the
    agent-registered a0 moves within the rules with its own token."""
    ok = grpc.StatusCode.OK
    assert (
        await run_stream(rig, bearer("shared"), [hello("n1", "http://192.168.4.4:8000"), snap(2, [7])]) == ok
    )
    assert await run_stream(rig, bearer("a0"), [hello("a0", "http://10.0.0.9:8000")]) == ok
    keys, urls = rig.state()
    assert keys["n1"] == [7] and keys["a0"] == [21, 22] and keys["r0"] == [1, 2, 3]
    assert urls["n1"] == "http://192.168.4.4:8000" and urls["a0"] == "http://10.0.0.9:8000"


async def test_impersonation_does_not_supersede_the_live_stream(rig: Rig) -> None:
    """r1's token saying Hello as r0 while r0's agent streams: r0's stream stays the writer and
    its later deltas still apply."""
    live = rig.call(bearer("r0"))
    await live.write(hello("r0"))
    await live.write(snap(2, [5]))
    while (await live.read()).ack.seq != 2:
        pass
    assert (
        await run_stream(rig, bearer("r1"), [hello("r0"), snap(2, [666])])
        == grpc.StatusCode.PERMISSION_DENIED
    )
    await live.write(events(3, stored(6)))
    while (await live.read()).ack.seq != 3:
        pass
    assert sorted(rig.index.precise_keys("r0")) == [5, 6]
    assert rig.server.connected_replicas() == ["r0"]
    await live.done_writing()
    assert await status_after_reading(live) == grpc.StatusCode.OK


async def test_real_agent_with_another_replicas_token(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """The agent's own client (replica_agent/gateway_client.py) holding r1's token but configured
    as r0: its attempts end PERMISSION_DENIED with that status (the client waits for the Hello's
    verdict), it logs an error and never connects; r0 keeps its index entries."""
    before = rig.state()
    outbox = Outbox(max_events=100)
    inventory = AgentInventory("m", 16, max_blocks=100, sink=outbox)
    info = HelloInfo("r0", "", ["m"], 16, 100, "vllm", "0")
    client = GatewayClient(
        Link(f"127.0.0.1:{rig.port}", token=TOKENS["r1"], seed=1, backoff_initial_s=0.01, backoff_max_s=0.02),
        Sources(inventory, outbox, lambda: info),
    )
    task = asyncio.create_task(client.run())
    try:
        for _ in range(1000):  # bounds a hang, not a speed
            if client.stats.failures >= 3:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert client.stats.failures >= 3 and client.stats.connects == 0
    assert client.stats.last_error.startswith("PERMISSION_DENIED")
    assert any(
        r.levelname == "ERROR" and "refused this agent's credentials" in r.getMessage()
        for r in caplog.records
    )
    assert rig.state() == before
