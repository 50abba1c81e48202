"""Shared state between gateway instances (gateway/shared_state*.py) against a real redis-server.

Two ``SharedState`` objects in one event loop, each with its own index, fleet and (unstarted)
inventory server, stand for two gateway instances: instance A is told of its agents' mutations
through the same hooks the inventory server calls, instance B must follow. The bounds (publish
queue, stream length, snapshot size) are enforced here; the codec's refusals too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.config import parse_config
from gateway.fleet import Fleet
from gateway.inventory_ops import Op, ops_of_events
from gateway.inventory_sink import AgentHello
from gateway.shared_state_codec import (
    CodecError,
    Header,
    Keys,
    LoadFigures,
    SnapshotBoundError,
    decode_header,
    decode_load,
    decode_ops,
    decode_snapshot,
    encode_header,
    encode_load,
    encode_ops,
    encode_snapshot,
    parse_stream_id,
)
from proto.kvgate.v1 import inventory_pb2 as pb
from router_policies.flights import Dispatch
from router_policies.policy import ReplicaState
from router_policies.prefix_index import MatchResult
from tests.integration.gateway_harness import RedisServer, SharedStateInstance, shared_state_instance
from tests.polling import until
from tests.unit.fleet_requests import NO_REQUEST


# ---------------------------------------------------------------------- codec
def test_ops_round_trip_keeps_order_media_and_full_uint64_range() -> None:
    ops = [
        Op("s", [1, 2**64 - 1, 2**63], "GPU"),
        Op("r", [2**64 - 1]),
        Op("c"),
        Op("s", [7], "CPU"),
        Op("r", []),
    ]
    assert list(decode_ops(encode_ops(ops))) == ops
    assert len(encode_ops([Op("s", list(range(64)))])) == 1 + 1 + 3 + 4 + 64 * 8


@pytest.mark.parametrize(
    "data",
    [
        b"x",  # unknown op
        b"s",  # no medium length
        b"s\x05GP",  # truncated medium
        b"r\x01\x00",  # truncated count
        b"r\x02\x00\x00\x00" + b"\x00" * 8,  # 2 keys announced, 1 present
        b"s\x01\xff\x00\x00\x00\x00",  # medium not UTF-8
    ],
)
def test_malformed_ops_are_refused(data: bytes) -> None:
    with pytest.raises(CodecError):
        list(decode_ops(data))


def test_snapshot_round_trip_and_bound() -> None:
    entries = {1: "GPU", 2: "CPU", 3: "GPU", 2**64 - 2: "CPU"}
    raw = encode_snapshot(entries)
    assert decode_snapshot(raw, bound=4) == entries
    with pytest.raises(SnapshotBoundError):
        decode_snapshot(raw, bound=3)
    with pytest.raises(CodecError, match="'r' op"):
        decode_snapshot(encode_ops([Op("r", [1])]), bound=10)


def test_load_round_trip_and_refusals() -> None:
    f = LoadFigures(3, 900, 120, owned=True, running=2, waiting=5, kv_usage=0.25)
    assert decode_load(encode_load(f)) == f
    for bad in (b"1,2,3", b"a,b,c,d,e,f,g", b"\xff"):
        with pytest.raises(CodecError):
            decode_load(bad)


def test_entry_header_round_trip_and_refusals() -> None:
    h = Header(b"d", 42, 1764400000.125, b"gw-7 with spaces")
    assert decode_header(encode_header(h)) == h
    for bad in (b"", b"x 1 2.0 o", b"d one 2.0 o", b"S 1 later o", b"d 1 2.0"):
        with pytest.raises(CodecError):
            decode_header(bad)


def test_stream_ids_order_numerically() -> None:
    assert parse_stream_id(b"10-2") > parse_stream_id("9-100")
    with pytest.raises(CodecError):
        parse_stream_id("abc")


# ---------------------------------------------------------------------- two instances
def make_instance(
    redis_url: str, name: str, clock: Callable[[], float] = time.monotonic, **shared: Any
) -> SharedStateInstance:
    index_cfg = shared.pop("index", {})
    config = parse_config(
        {
            "models": [{"name": "m"}],
            "replicas": [{"id": "r0", "url": "http://127.0.0.1:9", "models": ["m"]}],
            "index": index_cfg,
            "shared_state": {
                "redis_url": redis_url,
                "key_prefix": "unit",
                "load_interval_s": 0.05,
                "load_ttl_s": 0.5,
                "reconnect_max_s": 0.2,
                **shared,
            },
        }
    )
    return shared_state_instance(config, name, clock)


def stored(keys: list[int], medium: str = "GPU") -> pb.Event:
    return pb.Event(stored=pb.Stored(keys=keys, medium=medium))


def removed(keys: list[int]) -> pb.Event:
    return pb.Event(removed=pb.Removed(keys=keys))


HELLO = AgentHello("r9", "http://127.0.0.1:19", ("m",), 16, 1000, "sim", "1", "test")
HELLO_R0 = AgentHello("r0", "http://127.0.0.1:9", ("m",), 16, 1000, "sim", "1", "test")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    # small stream nodes so that approximate trimming (MAXLEN ~) trims close to the bound
    server = RedisServer(tmp_path, ("--stream-node-max-entries", "4"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def started() -> AsyncIterator[list[SharedStateInstance]]:
    instances: list[SharedStateInstance] = []
    try:
        yield instances
    finally:
        for inst in instances:
            await inst.shared.stop()


async def start(instances: list[SharedStateInstance], *new: SharedStateInstance) -> None:
    for inst in new:
        instances.append(inst)
        await inst.shared.start()
    await until(lambda: all(i.shared.up for i in new), "connected")


async def test_follower_converges_on_snapshot_and_deltas_and_registers_the_replica(
    redis_server: RedisServer, started: list[SharedStateInstance]
) -> None:
    a, b = make_instance(redis_server.url, "a"), make_instance(redis_server.url, "b")
    await start(started, a, b)
    a.shared.publisher.inventory_hello(HELLO)
    a.shared.publisher.inventory_snapshot("r9", {1: "GPU", 2: "GPU", 3: "CPU"})
    a.shared.publisher.inventory_ops("r9", ops_of_events([stored([4, 5]), removed([1])]))
    a.shared.publisher.inventory_ops(
        "r9", ops_of_events([pb.Event(cleared=pb.Cleared()), stored([10, 11, 12], "CPU")])
    )
    a.shared.publisher.inventory_ops("r9", ops_of_events([stored([13])]))
    await until(lambda: sorted(b.index.precise_keys("r9")) == [10, 11, 12, 13], "B follows r9")
    rec = b.fleet.get("r9")
    assert rec is not None and rec.url == "http://127.0.0.1:19" and not rec.static
    assert rec.link.shared and b.fleet.has_agent("r9")
    # the CPU medium travelled: three CPU blocks weigh 0.75 each
    assert b.index.match([10, 11, 12]).scores["r9"] == pytest.approx(2.25)
    assert b.sample("kvgate_shared_state_applied_total", {"kind": "snapshot"}) >= 1
    assert b.sample("kvgate_shared_state_up") == 1.0

    # a late instance starts from the snapshot and the deltas after it
    c = make_instance(redis_server.url, "c")
    await start(started, c)
    await until(lambda: sorted(c.index.precise_keys("r9")) == [10, 11, 12, 13], "C bootstraps r9")


async def test_publish_queue_drops_oldest_and_a_snapshot_heals_the_gap(
    redis_server: RedisServer, started: list[SharedStateInstance]
) -> None:
    a = make_instance(redis_server.url, "a", publish_queue=8)
    b = make_instance(redis_server.url, "b")
    await start(started, a, b)
    a.shared.publisher.inventory_hello(HELLO_R0)  # the inventory server always says hello first
    a.shared.publisher.inventory_snapshot("r0", {1: "GPU"})
    await until(lambda: b.index.precise_keys("r0") == [1], "B follows r0")
    # 50 batches without yielding to the loop: the publisher cannot run, the queue holds 8
    for k in range(100, 150):
        a.shared.publisher.inventory_ops("r0", ops_of_events([stored([k])]))
    assert a.sample("kvgate_shared_state_publish_queue") == 8
    assert a.sample("kvgate_shared_state_dropped_total", {"reason": "queue_full"}) == 42
    # B sees the gap in the entries' counter and stops applying deltas on a broken base
    await until(lambda: not b.shared.status()["following"], "B notices the gap")
    assert 149 not in b.index.precise_keys("r0")
    a.shared.publisher.inventory_snapshot("r0", {k: "GPU" for k in range(100, 150)})
    a.shared.publisher.inventory_ops("r0", ops_of_events([stored([150])]))
    await until(lambda: sorted(b.index.precise_keys("r0")) == list(range(100, 151)), "B healed")


async def test_stream_length_is_bounded(
    redis_server: RedisServer, started: list[SharedStateInstance]
) -> None:
    a = make_instance(redis_server.url, "a", stream_maxlen=16)
    await start(started, a)
    a.shared.publisher.inventory_hello(HELLO_R0)
    a.shared.publisher.inventory_snapshot("r0", {})
    for k in range(200):
        a.shared.publisher.inventory_ops("r0", ops_of_events([stored([k])]))
        await asyncio.sleep(0)
    await until(lambda: a.sample("kvgate_shared_state_published_total", {"kind": "delta"}) == 200, "sent")
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        length = await client.xlen(Keys("unit").stream("r0"))
    finally:
        await client.aclose()
    assert 16 <= length <= 16 + 4  # MAXLEN ~ trims whole stream nodes (4 entries here)


async def test_follower_refuses_a_snapshot_over_its_bound(
    redis_server: RedisServer, started: list[SharedStateInstance]
) -> None:
    a = make_instance(redis_server.url, "a")
    b = make_instance(redis_server.url, "b", index={"max_blocks_per_replica": 5})
    await start(started, a, b)
    a.shared.publisher.inventory_hello(HELLO_R0)  # the inventory server always says hello first
    a.shared.publisher.inventory_snapshot("r0", {k: "GPU" for k in range(10)})
    await until(lambda: b.sample("kvgate_shared_state_errors_total", {"kind": "index_bound"}) >= 1, "refusal")
    assert b.index.precise_keys("r0") == []
    a.shared.publisher.inventory_ops(
        "r0", ops_of_events([stored([99])])
    )  # no delta applies on a refused base
    a.shared.publisher.inventory_snapshot("r0", {1: "GPU", 2: "GPU"})
    await until(lambda: sorted(b.index.precise_keys("r0")) == [1, 2], "a snapshot within the bound")


async def test_load_of_other_instances_is_added_to_the_snapshot(
    redis_server: RedisServer, started: list[SharedStateInstance]
) -> None:
    a, b = make_instance(redis_server.url, "a"), make_instance(redis_server.url, "b")
    await start(started, a, b)
    rec_a = a.fleet.get("r0")
    assert rec_a is not None
    flights = [Fleet.begin(rec_a, tokens=100, prefill=60) for _ in range(3)]

    def b_view() -> tuple[int, int, int]:
        rec = b.fleet.get("r0")
        assert rec is not None
        (state,) = b.fleet.snapshot([rec], NO_REQUEST, MatchResult({}, {})).replicas
        return state.in_flight_requests, state.in_flight_tokens, state.pending_prefill_tokens

    await until(lambda: b_view() == (3, 300, 180), "B sees A's load")
    rec_b = b.fleet.get("r0")
    assert rec_b is not None and rec_b.in_flight_requests == 0  # B's own count is untouched
    for f in flights:
        f.end()
    await until(lambda: b_view() == (0, 0, 0), "A's load released")
    flights = [Fleet.begin(rec_a, tokens=10, prefill=0)]
    await until(lambda: b_view()[0] == 1, "B sees A's new load")
    await a.shared.stop()  # withdraws its load key at once
    await until(lambda: b_view()[0] == 0, "A's load gone with A")


async def test_redis_down_at_start_then_up(tmp_path: Path, started: list[SharedStateInstance]) -> None:
    server = RedisServer(tmp_path)  # its port is free: nothing listens yet
    a = make_instance(server.url, "a")
    started.append(a)
    await a.shared.start()
    await until(
        lambda: a.sample("kvgate_shared_state_errors_total", {"kind": "connection"}) >= 1,
        "a failed connection counted",
    )
    assert not a.shared.up and a.sample("kvgate_shared_state_up") == 0.0
    a.shared.publisher.inventory_ops("r0", ops_of_events([stored([1])]))  # never blocks, never raises
    assert a.sample("kvgate_shared_state_dropped_total", {"reason": "down"}) == 1
    try:
        server.start()
        await until(lambda: a.shared.up, "reconnected")
        server.stop()
        await until(lambda: not a.shared.up, "noticed the outage")
        assert a.sample("kvgate_shared_state_up") == 0.0
    finally:
        server.stop()


def test_config_refuses_a_load_ttl_not_longer_than_the_interval() -> None:
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match="load_ttl_s must exceed load_interval_s"):
        parse_config({"shared_state": {"load_interval_s": 2.0, "load_ttl_s": 2.0}})


async def test_a_replica_without_registration_is_forgotten(
    redis_server: RedisServer, started: list[SharedStateInstance]
) -> None:
    keys = Keys("unit")
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await client.sadd(keys.replicas, "ghost")  # its registration expired long ago
        b = make_instance(redis_server.url, "b")
        await start(started, b)
        for _ in range(200):
            if not await client.sismember(keys.replicas, "ghost"):
                break
            await asyncio.sleep(0.02)
        assert not await client.sismember(keys.replicas, "ghost")
    finally:
        await client.aclose()
    assert b.fleet.get("ghost") is None and "ghost" not in b.index.replicas


async def test_the_queue_age_crosses_instances_on_the_fleets_clock(
    redis_server: RedisServer, started: list[SharedStateInstance]
) -> None:
    """A request waiting for its first byte on A makes B's view of r0's queue as old as it is, by
    the fleets' clock (the one flights start on, injectable), not the process's monotonic one."""
    now = [500.0]
    a = make_instance(redis_server.url, "a", clock=lambda: now[0])
    b = make_instance(redis_server.url, "b", clock=lambda: now[0])
    await start(started, a, b)
    rec_a, rec_b = a.fleet.get("r0"), b.fleet.get("r0")
    assert rec_a is not None and rec_b is not None
    a.fleet.dispatch(rec_a, Dispatch(ReplicaState("r0"), 64, 0, 16, 8))  # dispatched at 500.0
    now[0] = 501.5  # waiting 1.5 s

    def age_at_b() -> float:
        return b.fleet.snapshot([rec_b], NO_REQUEST, MatchResult({}, {})).replicas[0].pending_age_ms

    await until(lambda: age_at_b() > 0, "B sees A's pending request")
    assert age_at_b() == pytest.approx(1500.0, abs=1.0)
