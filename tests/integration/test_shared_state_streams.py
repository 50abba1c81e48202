"""Shared state with real agent streams: two instances, each a started ``InventoryServer`` (gRPC on
a free port) with its ``SharedState``, against a real redis-server. An agent stream (raw gRPC
messages, as the agent sends them) moves from instance A to instance B, as it does when a gateway
pod goes away behind a Kubernetes Service: B becomes the replica's writer, A its follower, and
both converge on what the agent said last. The owner asks its agent for a fresh snapshot every
``stream_maxlen // 2`` deltas and after Redis restarts.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from gateway.config import parse_config
from gateway.fleet import Fleet
from gateway.inventory_server import InventoryServer
from gateway.shared_state import REPLICA_KEYS_TTL_S, SharedState
from gateway.shared_state_codec import Keys
from proto.kvgate.v1 import inventory_pb2 as pb
from router_policies.prefix_index import PrefixIndex
from tests.integration.gateway_harness import RedisServer, shared_state_instance
from tests.polling import until

pytestmark = pytest.mark.timeout(120)


@dataclass
class Node:
    index: PrefixIndex
    fleet: Fleet
    inventory: InventoryServer
    shared: SharedState
    port: int
    channel: grpc.aio.Channel

    def keys(self, replica: str) -> list[int]:
        return sorted(self.index.precise_keys(replica))


async def make_node(redis_url: str, name: str) -> Node:
    config = parse_config(
        {
            "models": [{"name": "m"}],
            "shared_state": {
                "redis_url": redis_url,
                "key_prefix": "streams",
                "stream_maxlen": 16,
                "load_interval_s": 0.05,
                "load_ttl_s": 0.5,
                "reconnect_max_s": 0.2,
            },
        }
    )
    node = shared_state_instance(config, name)
    index, fleet, inventory, shared = node.index, node.fleet, node.inventory, node.shared
    port = await inventory.start("127.0.0.1:0")
    await shared.start()
    # an agent arriving before the connection is asked for a snapshot once it is up (the test's
    # agents do not answer resyncs unless told to), so the tests start on a connected instance
    await until(lambda: shared.up, "connected")
    return Node(index, fleet, inventory, shared, port, grpc.aio.insecure_channel(f"127.0.0.1:{port}"))


@pytest.fixture
async def nodes(redis_server: RedisServer) -> AsyncIterator[tuple[Node, Node]]:
    a = await make_node(redis_server.url, "a")
    b = await make_node(redis_server.url, "b")
    try:
        yield a, b
    finally:
        for n in (a, b):
            await n.channel.close()
            await n.inventory.stop(0)
            await n.shared.stop()


class Agent:
    """One agent stream, speaking the agent's side of Inventory.Sync."""

    def __init__(self, node: Node, replica: str) -> None:
        sync = node.channel.stream_stream(
            "/kvgate.v1.Inventory/Sync",
            request_serializer=pb.AgentMessage.SerializeToString,
            response_deserializer=pb.GatewayMessage.FromString,
        )
        self.call = sync()
        self.replica = replica
        self.seq = 0
        self.resyncs: list[str] = []
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            msg = await self.call.read()
            if msg is grpc.aio.EOF:
                return
            if msg.WhichOneof("body") == "resync":
                self.resyncs.append(msg.resync.reason)

    async def send(self, **body: object) -> None:
        self.seq += 1
        await self.call.write(pb.AgentMessage(seq=self.seq, **body))  # type: ignore[arg-type]

    async def hello(self) -> None:
        await self.send(
            hello=pb.Hello(
                replica_id=self.replica,
                url="http://127.0.0.1:19",
                models=["m"],
                block_size=16,
                capacity_blocks=1000,
                engine="sim",
                protocol_version=1,
            )
        )

    async def snapshot(self, keys: list[int]) -> None:
        await self.send(snapshot=pb.SnapshotChunk(snapshot_id=self.seq + 1, keys=keys, last=True))

    async def store(self, *keys: int) -> None:
        await self.send(events=pb.Events(events=[pb.Event(stored=pb.Stored(keys=list(keys)))]))

    async def close(self) -> None:
        await self.call.done_writing()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


async def _ttl_set(client: aioredis.Redis, name: str) -> bool:
    ttl = await client.ttl(name)
    return bool(0 < ttl <= REPLICA_KEYS_TTL_S)


async def streamed(owner: Node, follower: Node, rid: str, keys: list[int], what: str) -> Agent:
    """An agent of ``rid`` connected to ``owner``: a snapshot of ``keys`` but the last, then the last
    one stored; returns once ``follower`` follows it through Redis (without an agent of its own)."""
    agent = Agent(owner, rid)
    await agent.hello()
    await agent.snapshot(keys[:-1])
    await agent.store(keys[-1])
    await until(lambda: owner.keys(rid) == keys == follower.keys(rid), what)
    rec = follower.fleet.get(rid)
    assert rec is not None and rec.link.shared and not rec.agent_connected
    return agent


async def test_ownership_moves_with_the_agent_stream(
    nodes: tuple[Node, Node], redis_server: RedisServer
) -> None:
    a, b = nodes
    redis_url = redis_server.url
    agent = await streamed(a, b, "r5", [1, 2, 3, 4], "B follows A's agent")
    # the owner keeps the replica's keys alive while it holds the agent (they expire otherwise)
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = Keys("streams")
        for name in (keys.stream("r5"), keys.snapshot("r5"), keys.replica("r5")):
            await until(functools.partial(_ttl_set, client, name), f"TTL on {name}")
    finally:
        await client.aclose()

    # the agent reconnects to B (A went away behind the Service): B now writes r5, A follows B
    await agent.close()
    await until(lambda: a.inventory.connected_replicas() == [], "A's stream closed")
    moved = await streamed(b, a, "r5", [1, 2, 7, 8], "A follows B's agent")
    await moved.close()


async def test_owner_refreshes_the_snapshot_and_republishes_after_redis_restart(
    nodes: tuple[Node, Node], redis_server: RedisServer
) -> None:
    a, b = nodes
    agent = Agent(a, "r6")
    await agent.hello()
    await agent.snapshot([1])
    for k in range(10, 18):  # stream_maxlen // 2 = 8 deltas
        await agent.store(k)
    await until(lambda: "shared_state" in agent.resyncs, "refresh asked of the agent")
    await until(lambda: b.keys("r6") == [1, *range(10, 18)], "B follows")

    # Redis restarts empty: the owner asks its agent for a snapshot and republishes it
    asked = len(agent.resyncs)
    redis_server.stop()
    await until(lambda: not a.shared.up and not b.shared.up, "both down")
    redis_server.start()
    await until(lambda: a.shared.up and b.shared.up, "both up again")
    await until(lambda: len(agent.resyncs) > asked, "resync asked after the reconnect")
    await agent.snapshot([1, 2])  # what the agent holds now
    await until(lambda: b.keys("r6") == [1, 2] == a.keys("r6"), "B resynced from the new snapshot")
    await agent.close()
