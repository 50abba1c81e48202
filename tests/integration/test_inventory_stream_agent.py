"""The agent's gateway client against the real inventory server over gRPC on loopback: a snapshot
after connecting, deltas, a snapshot on Resync, reconnecting after a gateway restart with the same
index as a result, TLS."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.inventory_server import InventoryServer, InventorySettings
from replica_agent.engine_events import BlockRemoved, BlockStored
from replica_agent.gateway_client import GatewayClient, HelloInfo, Link, Sources
from replica_agent.inventory import AgentInventory
from replica_agent.outbox import Outbox
from router_policies.prefix_index import PrefixIndex
from tests.integration.fleet_recorder import RecordingFleet
from tests.integration.gateway_harness import low_free_port

TOKEN = "t0ken"


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(1000):  # bounds a hang, not a speed
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def stored(h: int, parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored([h], parent, tokens, 2, "GPU", None, None)


class Agent:
    """The agent's inventory, outbox and gateway client, driven directly by the test."""

    def __init__(self, port: int, tls_ca: bytes | None = None, token: str | None = TOKEN) -> None:
        self.outbox = Outbox(max_events=1000)
        self.inventory = AgentInventory("m", 2, max_blocks=1000, sink=self.outbox)
        hello = HelloInfo("r0", "http://127.0.0.1:9", ["m"], 2, 100, "vllm", "0")
        target = f"localhost:{port}" if tls_ca else f"127.0.0.1:{port}"
        self.client = GatewayClient(
            Link(target, token=token, tls_ca=tls_ca, seed=1, backoff_initial_s=0.05, backoff_max_s=0.2),
            Sources(self.inventory, self.outbox, lambda: hello),
        )
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.client.run())

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def serve(index: PrefixIndex, port: int, **tls: str) -> InventoryServer:
    fleet = RecordingFleet(index, ("r0",), block_size=2)
    settings = InventorySettings(**tls)  # type: ignore[arg-type]
    server = InventoryServer(index, fleet, token=TOKEN, registry=CollectorRegistry(), settings=settings)
    assert await server.start(f"127.0.0.1:{port}" if not tls else f"localhost:{port}") == port
    return server


@pytest.fixture
async def stopped() -> AsyncIterator[list[InventoryServer]]:
    servers: list[InventoryServer] = []
    yield servers
    for s in servers:
        await s.stop(0)


async def test_snapshot_deltas_resync_and_gateway_restart(stopped: list[InventoryServer]) -> None:
    port = low_free_port()
    index = PrefixIndex()
    server = await serve(index, port)
    stopped.append(server)
    agent = Agent(port)
    agent.inventory.apply([stored(1, None, [1, 2]), stored(2, 1, [3, 4])])  # before connecting
    agent.start()
    try:
        await until(lambda: sorted(index.precise_keys("r0")) == sorted(agent.inventory.keys()) != [])
        agent.inventory.apply([stored(3, 2, [5, 6]), BlockRemoved([1], "GPU")])
        await until(lambda: sorted(index.precise_keys("r0")) == sorted(agent.inventory.keys()))
        assert len(index.precise_keys("r0")) == 2

        # Resync: the gateway's index is wrong (say a bug); a snapshot repairs it
        index.store("r0", [999])
        assert server.request_resync("r0")
        await until(lambda: agent.client.stats.snapshots_sent == 2)
        await until(lambda: sorted(index.precise_keys("r0")) == sorted(agent.inventory.keys()))

        # gateway restart: the agent keeps following its engine while the gateway is down
        await server.stop(0)
        agent.inventory.apply([stored(4, 3, [7, 8]), BlockRemoved([2], "GPU")])
        fresh = PrefixIndex()
        server2 = await serve(fresh, port)
        stopped.append(server2)
        await until(lambda: sorted(fresh.precise_keys("r0")) == sorted(agent.inventory.keys()))
        assert agent.client.stats.connects == 2
    finally:
        await agent.stop()


async def test_wrong_token_never_touches_the_index(stopped: list[InventoryServer]) -> None:
    port = low_free_port()
    index = PrefixIndex()
    stopped.append(await serve(index, port))
    agent = Agent(port, token="wrong")
    agent.inventory.apply([stored(1, None, [1, 2])])
    agent.start()
    try:
        await until(lambda: agent.client.stats.failures >= 2)
        assert "UNAUTHENTICATED" in agent.client.stats.last_error
        assert index.entries == 0 and index.precise_keys("r0") == []
    finally:
        await agent.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
async def test_tls(tmp_path: Path, stopped: list[InventoryServer]) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    await asyncio.to_thread(
        subprocess.run,
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    port = low_free_port()
    index = PrefixIndex()
    stopped.append(await serve(index, port, tls_cert=str(cert), tls_key=str(key)))
    agent = Agent(port, tls_ca=cert.read_bytes())
    agent.inventory.apply([stored(1, None, [1, 2])])
    agent.start()
    try:
        await until(lambda: index.precise_keys("r0") == agent.inventory.keys())
    finally:
        await agent.stop()
    plain = Agent(port)  # plaintext against a TLS server: never connects
    plain.client.link = dataclasses.replace(plain.client.link, target=f"localhost:{port}")
    plain.start()
    try:
        await until(lambda: plain.client.stats.failures >= 1)
        assert plain.client.stats.connects == 0
    finally:
        await plain.stop()
