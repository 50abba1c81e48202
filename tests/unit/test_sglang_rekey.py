"""An SGLang replica at its default page size (1 token) behind a gateway keying 16-token blocks:
the agent learns the gateway's block size from the Ack of its Hello, rebuilds its inventory at
that size from the engine's replay buffer, says Hello again at 16, and the gateway's index then
holds exactly the keys computed from the token ids at 16 (never keys of 1-token blocks that no
request could match).

Real parts: the recorded bytes of SGLang 0.5.23's own radix cache and publisher, served by ZMQ
PUB + ROUTER sockets on loopback; the agent's subscriber, inventory, outbox, gateway client and
hello/re-key callbacks; the gateway's Fleet, PrefixIndex and InventoryServer over gRPC."""

from __future__ import annotations

import asyncio

import zmq.asyncio
from prometheus_client import CollectorRegistry

from gateway.asyncio_tasks import cancel_and_wait
from gateway.config import parse_config
from gateway.fleet import Fleet
from gateway.inventory_server import InventoryServer
from replica_agent.agent import Agent, AgentConfig
from replica_agent.gateway_client import GatewayClient, Link, Sources
from replica_agent.inventory import AgentInventory
from replica_agent.subscriber import EventSubscriber
from router_policies.prefix_index import PrefixIndex
from tests.integration.gateway_harness import low_free_port
from tests.integration.test_inventory_stream_agent import until
from tests.unit.test_sglang_events import _expected_keys, _load
from tests.zmq_publisher import Publisher

REC = "0.5.23/page1"


class Engine(Publisher):
    """The recorded engine: its replay ROUTER answers with the recorded frames, byte for byte."""

    def __init__(self, ctx: zmq.asyncio.Context, recorded: list[list[bytes]]) -> None:
        self.recorded = recorded
        self.requests = 0
        super().__init__(ctx)

    async def _serve_replay(self) -> None:
        while True:
            ident, _empty, _start = await self.router.recv_multipart()
            self.requests += 1
            for frames in self.recorded:
                await self.router.send_multipart([ident, *frames])


async def test_page_size_1_is_rekeyed_at_the_gateways_block_size() -> None:
    live, replay, expected = _load(REC)
    model = expected["model"]
    ctx = zmq.asyncio.Context()
    engine = Engine(ctx, replay)
    config = parse_config({"models": [{"name": model, "block_size": 16}], "replicas": []})
    index = PrefixIndex()
    fleet = Fleet(config, index)
    port = low_free_port()
    server = InventoryServer(index, fleet, token=None, registry=CollectorRegistry())
    assert await server.start(f"127.0.0.1:{port}") == port
    agent = Agent(AgentConfig("r0", "http://127.0.0.1:9", "", f"127.0.0.1:{port}", engine_kind="sglang"))
    agent.models = [model]
    inv = agent.inventory = AgentInventory(model, None, 100_000, sink=agent.outbox)
    sub = agent.subscriber = EventSubscriber(
        ctx, f"tcp://127.0.0.1:{engine.pub_port}", f"tcp://127.0.0.1:{engine.replay_port}", inv
    )
    client = agent.client = GatewayClient(
        Link(f"127.0.0.1:{port}", seed=1, backoff_initial_s=0.05, backoff_max_s=0.2),
        Sources(
            inv, agent.outbox, agent._hello, state=agent._state, on_key_block_size=agent._gateway_block_size
        ),
    )
    tasks = [asyncio.create_task(sub.run()), asyncio.create_task(client.run())]
    try:
        # the engine's cache as the agent first keys it: 1-token blocks (SGLang's default page)
        await until(lambda: inv.block_size == 1 and len(inv) > 0)
        assert inv.reported_block_size in (1, 16)
        want = _expected_keys(expected, 16)
        await until(lambda: set(index.precise_keys("r0")) == want)
        rec = fleet.get("r0")
        assert rec is not None and rec.identity.block_size == 16
        assert inv.key_block_size == 16 and set(inv.keys()) == want and not inv.degraded
        assert engine.requests >= 2  # the start-up catch-up, then the rebuild at 16
        # the live stream goes on at 16: a batch already applied through replay is stale
        await engine.pub.send_multipart(live[-1])
        await until(lambda: sub.stats.stale >= 1)
        assert set(index.precise_keys("r0")) == want
    finally:
        for t in tasks:
            await cancel_and_wait(t)
        await server.stop(0)
        await engine.close()
        ctx.destroy(linger=0)


async def _keyed_at_1(ctx: zmq.asyncio.Context, replay: str | None) -> tuple[AgentInventory, EventSubscriber]:
    live, _replay, expected = _load(REC)
    inv = AgentInventory(expected["model"], None, 100_000)
    sub = EventSubscriber(ctx, "tcp://127.0.0.1:9", replay, inv, replay_timeout_s=2.0)
    for frames in live:
        await sub.handle_frames(frames)
    assert inv.block_size == 1 and set(inv.keys()) == _expected_keys(expected, 1)
    return inv, sub


async def test_rekey_without_replay_starts_empty_and_degraded() -> None:
    ctx = zmq.asyncio.Context()
    try:
        inv, sub = await _keyed_at_1(ctx, None)
        await sub.rekey(16)
        assert inv.key_block_size == 16 and len(inv) == 0 and inv.degraded
    finally:
        ctx.destroy(linger=0)


async def test_rekey_with_a_replay_buffer_that_no_longer_reaches_seq_0_is_degraded() -> None:
    _live, replay, expected = _load(REC)
    ctx = zmq.asyncio.Context()
    engine = Engine(ctx, replay[1:])  # the buffer dropped the first batch
    try:
        inv, sub = await _keyed_at_1(ctx, f"tcp://127.0.0.1:{engine.replay_port}")
        await sub.rekey(16)
        assert inv.key_block_size == 16 and inv.degraded
        # what it holds is still only what the engine holds
        assert set(inv.keys()) <= _expected_keys(expected, 16)
    finally:
        await engine.close()
        ctx.destroy(linger=0)
