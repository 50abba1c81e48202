"""The agent's EngineState over real gRPC on loopback: the gateway learns that a replica is hybrid
when its agent's inventory turns hybrid (vLLM events of two KV-cache groups), matches it by the
deepest reported key from then on, and follows the LoRA adapters the agent reports."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry

from gateway.inventory_server import InventoryServer
from proto.kvgate.v1 import inventory_pb2 as pb
from replica_agent.engine_events import BlockStored, EngineHash
from replica_agent.gateway_client import GatewayClient, HelloInfo, Link, Sources
from router_policies.block_keys import block_keys
from router_policies.prefix_index import PrefixIndex
from tests.integration.fleet_recorder import RecordingFleet
from tests.integration.gateway_harness import low_free_port
from tests.integration.test_inventory_stream_agent import TOKEN, Agent, until


def grouped(hashes: list[int], tokens: list[int], group: int, window: int | None = None) -> BlockStored:
    kind = "full_attention" if window is None else "sliding_window"
    return BlockStored(list[EngineHash](hashes), None, tokens, 2, "GPU", None, None, group, kind, window)


def engine_agent(port: int, engine: Callable[[], pb.EngineState]) -> Agent:
    """The test agent, its client given an EngineState provider (as agent.py gives it)."""
    agent = Agent(port)
    hello = HelloInfo("r0", "http://127.0.0.1:9", ["m"], 2, 100, "vllm", "0")
    agent.client = GatewayClient(
        Link(f"127.0.0.1:{port}", token=TOKEN, seed=1, backoff_initial_s=0.05, backoff_max_s=0.2),
        Sources(agent.inventory, agent.outbox, lambda: hello, engine=engine),
    )
    return agent


@pytest.fixture
async def served() -> AsyncIterator[tuple[PrefixIndex, RecordingFleet, int]]:
    port = low_free_port()
    index = PrefixIndex()
    fleet = RecordingFleet(index, ("r0",), block_size=2)
    server = InventoryServer(index, fleet, token=TOKEN, registry=CollectorRegistry())
    assert await server.start(f"127.0.0.1:{port}") == port
    yield index, fleet, port
    await server.stop(0)


async def test_hybrid_flag_and_adapters_reach_the_fleet(
    served: tuple[PrefixIndex, RecordingFleet, int],
) -> None:
    index, fleet, port = served
    adapters: list[frozenset[str] | None] = [None]
    agent = engine_agent(
        port,
        lambda: pb.EngineState(
            hybrid=agent.inventory.hybrid,
            lora_adapters=sorted(adapters[0] or ()),
            adapters_known=adapters[0] is not None,
        ),
    )
    agent.start()
    try:
        tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
        k = block_keys(tokens, 2, "m")
        await until(lambda: agent.client.connected.is_set())
        rec = fleet.get("r0")
        assert rec is not None and not rec.identity.hybrid and rec.identity.adapters is None
        # Gemma-3 shape: window group 0 (4 tokens) caches the last two blocks, group 1 all five
        agent.inventory.apply(
            [grouped([13, 14], tokens, group=0, window=4), grouped([10, 11, 12, 13, 14], tokens, group=1)]
        )
        await until(lambda: index.precise_keys("r0") == [k[4]] and index.is_hybrid("r0"))
        assert fleet.get("r0").identity.hybrid  # type: ignore[union-attr]
        # the deepest key, not a leading run (there is none: block 0 is no hit)
        assert index.match(k, max_blocks=4).blocks == {}
        assert dict(index.match(k, max_blocks=5).blocks) == {"r0": 5}
        adapters[0] = frozenset({"sql", "chat"})
        agent.outbox.wake.set()
        await until(lambda: fleet.get("r0").identity.adapters == {"sql", "chat"})  # type: ignore[union-attr]
        adapters[0] = frozenset({"chat"})  # "sql" unloaded
        agent.outbox.wake.set()
        await until(lambda: fleet.get("r0").identity.adapters == {"chat"})  # type: ignore[union-attr]
    finally:
        await agent.stop()


async def test_too_many_adapters_are_refused_and_change_nothing(
    served: tuple[PrefixIndex, RecordingFleet, int],
) -> None:
    _, fleet, port = served
    agent = engine_agent(
        port, lambda: pb.EngineState(lora_adapters=[f"a{i}" for i in range(5000)], adapters_known=True)
    )
    agent.start()
    try:
        await until(lambda: agent.client.stats.failures >= 1)
        assert "adapters" in agent.client.stats.last_error
        assert fleet.get("r0").identity.adapters is None  # type: ignore[union-attr]
    finally:
        with contextlib.suppress(Exception):
            await agent.stop()
