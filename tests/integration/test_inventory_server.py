"""The gateway's inventory server over real gRPC on loopback: auth, malformed input, bounds,
unknown replicas and block-size mismatches are refused with a clear status and leave the index
unchanged; snapshots replace atomically; one writer per replica."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc
import grpc.aio
import pytest
from prometheus_client import CollectorRegistry

from gateway.inventory_server import InventoryServer, InventorySettings
from gateway.inventory_sink import AgentLoad
from kvgate_tools.stream_agent import events, hello, removed, snap, status_after_reading, stored, sync_call
from proto.kvgate.v1 import inventory_pb2 as pb
from router_policies.prefix_index import IndexConfig, PrefixIndex
from tests.integration.fleet_recorder import RecordingFleet

TOKEN = "s3cret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


class Rig:
    def __init__(
        self,
        server: InventoryServer,
        fleet: RecordingFleet,
        index: PrefixIndex,
        registry: CollectorRegistry,
        channel: grpc.aio.Channel,
    ) -> None:
        self.server, self.fleet, self.index, self.registry, self.channel = (
            server,
            fleet,
            index,
            registry,
            channel,
        )

    def call(self, metadata: Sequence[tuple[str, str]] | None = AUTH) -> grpc.aio.StreamStreamCall:
        return sync_call(self.channel, metadata)

    def refused(self, reason: str) -> float:
        value = self.registry.get_sample_value("kvgate_inventory_streams_refused_total", {"reason": reason})
        return value or 0.0

    def state(self) -> dict[str, list[int]]:
        """Each replica's precise blocks (replicas holding none left out)."""
        return {r: sorted(keys) for r in self.index.replicas if (keys := self.index.precise_keys(r))}


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    index = PrefixIndex(IndexConfig(max_blocks_per_replica=5000))
    fleet = RecordingFleet(index)
    registry = CollectorRegistry()
    server = InventoryServer(
        index,
        fleet,
        token=TOKEN,
        registry=registry,
        settings=InventorySettings(block_bound_factor=4.0, ack_every=1),
    )
    port = await server.start("127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Rig(server, fleet, index, registry, channel)
    finally:
        await channel.close()
        await server.stop(0)


async def send(call: grpc.aio.StreamStreamCall, msg: pb.AgentMessage | bytes) -> None:
    """Write to a stream the server may already have closed (its status is what a test checks)."""
    with contextlib.suppress(Exception):
        await call.write(msg)


async def read_until_ack(call: grpc.aio.StreamStreamCall, seq: int) -> None:
    while True:
        msg = await call.read()
        assert msg is not grpc.aio.EOF, "stream ended before the ack"
        if msg.WhichOneof("body") == "ack" and msg.ack.seq >= seq:
            return


async def establish(
    rig: Rig, replica: str = "r0", keys: Sequence[int] = (1, 2, 3)
) -> grpc.aio.StreamStreamCall:
    call = rig.call()
    await call.write(hello(replica))
    await call.write(snap(2, keys))
    await read_until_ack(call, 2)
    return call


async def test_snapshot_then_deltas(rig: Rig) -> None:
    call = await establish(rig)
    assert rig.state() == {"r0": [1, 2, 3]}
    await call.write(events(3, stored(4, 5), removed(1)))
    await call.write(pb.AgentMessage(seq=4, load=pb.Load(running=3, waiting=1, kv_usage=0.5)))
    await read_until_ack(call, 4)
    assert rig.state() == {"r0": [2, 3, 4, 5]}
    assert rig.fleet.loads[-1] == ("r0", AgentLoad(3, 1, 0.5, 0, 0))
    assert rig.fleet.states[-1] == ("r0", True, False)
    # a second snapshot replaces the inventory (chunked)
    await call.write(snap(5, [7, 8], sid=2, last=False))
    await call.write(snap(6, [9], sid=2, last=True))
    await read_until_ack(call, 6)
    assert rig.state() == {"r0": [7, 8, 9]}
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    assert rig.fleet.states[-1] == ("r0", False, False)
    assert rig.state() == {"r0": [7, 8, 9]}  # entries outlive the stream
    assert rig.registry.get_sample_value("kvgate_inventory_events_applied_total", {"kind": "stored"}) == 2


@pytest.mark.parametrize(
    "metadata", [None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]
)
async def test_wrong_token_is_refused(rig: Rig, metadata: Sequence[tuple[str, str]] | None) -> None:
    await (await establish(rig)).done_writing()
    before = rig.state()
    call = rig.call(metadata)
    await send(call, hello("r1"))
    assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "token" in (await call.details() or "")
    assert rig.state() == before
    assert rig.refused("auth") == 1
    assert [h.replica_id for h in rig.fleet.hellos] == ["r0"]


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08" + b"\xff" * 11])
async def test_garbage_protobuf_is_refused(rig: Rig, garbage: bytes) -> None:
    call = await establish(rig)
    before = rig.state()
    await send(call, garbage)
    assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed" in (await call.details() or "")
    assert rig.state() == before
    assert rig.refused("malformed") == 1


async def test_garbage_before_hello_is_refused(rig: Rig) -> None:
    call = rig.call()
    await send(call, b"\x12\x03\x0a\x01")  # truncated hello
    assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rig.state() == {}


async def test_snapshot_ten_times_the_bound_is_refused(rig: Rig) -> None:
    call = await establish(rig)  # capacity 100, factor 4: bound 400
    before = rig.state()
    keys = list(range(1000, 1000 + 4000))
    await send(call, snap(3, keys[:2000], sid=2, last=False))
    await send(call, snap(4, keys[2000:], sid=2, last=True))
    assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "bound of 400" in (await call.details() or "")
    assert rig.state() == before
    assert rig.refused("block_bound") == 1


async def test_deltas_over_the_bound_are_refused_whole(rig: Rig) -> None:
    call = await establish(rig, keys=list(range(1, 391)))
    before = rig.state()
    # 20 new blocks and 5 removals: 405 > 400; nothing of the batch may be applied
    await send(call, events(3, removed(1, 2, 3, 4, 5), stored(*range(10_000, 10_020))))
    assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rig.state() == before


async def test_deltas_near_the_bound_that_fit_are_applied(rig: Rig) -> None:
    call = await establish(rig, keys=list(range(1, 391)))
    await call.write(events(3, removed(*range(1, 21)), stored(*range(10_000, 10_030))))
    await read_until_ack(call, 4 - 1)
    await call.write(pb.AgentMessage(seq=4, load=pb.Load()))
    await read_until_ack(call, 4)
    assert rig.index.precise_count("r0") == 400


@pytest.mark.parametrize(
    ("replica", "block_size", "needle"), [("stranger", 16, "not in the config"), ("r1", 32, "block size 32")]
)
async def test_hello_refused_by_the_fleet(rig: Rig, replica: str, block_size: int, needle: str) -> None:
    await (await establish(rig)).done_writing()
    before = rig.state()
    call = rig.call()
    await send(call, hello(replica, block_size=block_size))
    assert await call.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert needle in (await call.details() or "")
    assert rig.state() == before
    assert rig.refused("hello_refused") == 1


async def test_protocol_errors(rig: Rig) -> None:
    call = rig.call()
    await send(call, snap(1, [1]))
    assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first message must be hello" in (await call.details() or "")
    call = rig.call()
    await send(call, pb.AgentMessage(seq=1))
    assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_second_stream_supersedes_the_first(rig: Rig) -> None:
    first = await establish(rig, keys=[1, 2])
    second = await establish(rig, keys=[3])
    assert await first.code() == grpc.StatusCode.ABORTED
    assert "superseded" in (await first.details() or "")
    assert rig.state() == {"r0": [3]}
    await second.write(events(3, stored(4)))
    await second.write(pb.AgentMessage(seq=4, load=pb.Load()))
    await read_until_ack(second, 4)
    assert rig.state() == {"r0": [3, 4]}
    assert rig.server.connected_replicas() == ["r0"]
    # the superseded stream's end does not mark the replica disconnected
    assert rig.fleet.states[-1] == ("r0", True, False)


async def test_stream_seq_gap_asks_for_a_resync(rig: Rig) -> None:
    call = await establish(rig)
    await call.write(events(7, stored(9)))  # seq 3..6 never came
    msg = await call.read()
    assert msg.WhichOneof("body") == "resync"
    await call.write(snap(8, [1, 9], sid=5))
    await read_until_ack(call, 8)
    assert rig.state() == {"r0": [1, 9]}
    assert rig.registry.get_sample_value("kvgate_inventory_gaps_total", {"kind": "stream"}) == 1


async def test_acks_are_paced_and_coalesce_but_a_resync_is_not_held(rig: Rig) -> None:
    """``ack_interval_s`` (here 2 s): the hello's ack goes at once; the acks owed for the deltas
    sent within the interval become one, the newest, no sooner than the interval after it; a
    resync owed while an ack waits goes at once, before that ack."""
    interval = 2.0
    server = InventoryServer(
        rig.index,
        rig.fleet,
        token=TOKEN,
        registry=CollectorRegistry(),
        settings=InventorySettings(ack_interval_s=interval),
    )
    port = await server.start("127.0.0.1:0")
    loop = asyncio.get_running_loop()
    try:
        await _paced(grpc.aio.insecure_channel(f"127.0.0.1:{port}"), rig, loop, interval)
    finally:
        await server.stop(0)


async def _paced(
    channel: grpc.aio.Channel, rig: Rig, loop: asyncio.AbstractEventLoop, interval: float
) -> None:
    async with channel:
        call = sync_call(channel, AUTH)
        await call.write(hello("r0"))
        first = await call.read()
        acked_at = loop.time()
        assert first.WhichOneof("body") == "ack" and first.ack.seq == 1
        await call.write(snap(2, [1, 2]))
        for seq in range(3, 7):
            await call.write(events(seq, stored(10 + seq)))
        msg = await call.read()
        assert msg.WhichOneof("body") == "ack" and msg.ack.seq == 6  # one ack for five messages
        # held for the interval (the client's own read delays can only shorten what it sees by
        # milliseconds; without pacing this ack comes in a few)
        assert loop.time() - acked_at >= interval * 0.5
        assert sorted(rig.index.precise_keys("r0")) == [1, 2, 13, 14, 15, 16]
        acked_at = loop.time()
        await call.write(events(7, stored(30)))  # an ack owed, waiting for the interval
        await call.write(events(9, stored(31)))  # seq 8 never came
        msg = await call.read()
        assert msg.WhichOneof("body") == "resync"
        assert loop.time() - acked_at < interval * 0.75  # not held for the ack's interval
        msg = await call.read()
        assert msg.WhichOneof("body") == "ack" and msg.ack.seq == 9  # the newest owed
        call.cancel()


async def test_deltas_during_a_chunked_snapshot_apply_to_it(rig: Rig) -> None:
    call = await establish(rig)
    await call.write(snap(3, [10, 11], sid=2, last=False))
    await call.write(events(4, removed(10), stored(12)))
    await read_until_ack(call, 4)  # both messages handled
    assert rig.state() == {"r0": [1, 2, 3]}  # nothing applied until the last chunk
    await call.write(snap(5, [13], sid=2, last=True))
    await read_until_ack(call, 5)
    assert rig.state() == {"r0": [11, 12, 13]}


async def test_agent_state_reports_degraded_and_gaps(rig: Rig) -> None:
    call = await establish(rig)
    await call.write(
        pb.AgentMessage(seq=3, state=pb.AgentState(degraded=True, engine_gaps=3, unrecovered_gaps=1))
    )
    await call.write(pb.AgentMessage(seq=4, load=pb.Load()))
    await read_until_ack(call, 4)
    assert rig.fleet.states[-1] == ("r0", True, True)
    assert rig.registry.get_sample_value("kvgate_inventory_gaps_total", {"kind": "engine_recovered"}) == 2
    assert rig.registry.get_sample_value("kvgate_inventory_gaps_total", {"kind": "engine_unrecovered"}) == 1


REFUSAL_RUNS = 25
STATUS_WITHIN_S = 10.0  # a delivered status takes milliseconds; a lost one never comes


@pytest.mark.parametrize(
    ("after_hello", "code"),
    [
        (hello(), grpc.StatusCode.INVALID_ARGUMENT),  # a second hello
        (b"\xff\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT),  # garbage
        (b"", grpc.StatusCode.INVALID_ARGUMENT),  # an empty message
        (snap(2, range(1000, 1500)), grpc.StatusCode.RESOURCE_EXHAUSTED),  # over the bound of 400
    ],
    ids=["second-hello", "garbage", "empty", "over-bound"],
)
async def test_a_refusal_right_after_the_hello_is_always_delivered(
    rig: Rig, after_hello: pb.AgentMessage | bytes, code: grpc.StatusCode
) -> None:
    """The refusal lands while the gateway writes the hello's ack: its status must still arrive,
    every time (it used to be lost in some runs: the abort collided with the write in flight)."""
    for run in range(REFUSAL_RUNS):
        call = rig.call()
        await send(call, hello())
        await send(call, after_hello)
        got = await asyncio.wait_for(status_after_reading(call), STATUS_WITHIN_S)
        assert got == code, f"run {run}: {got} {await call.details()!r}"
    assert rig.state() == {}
    assert rig.server.connected_replicas() == []


async def test_a_refusal_among_acks_in_flight_is_always_delivered(rig: Rig) -> None:
    """Garbage after a burst of messages, each acknowledged: the writer is busy writing acks when
    the refusal comes, and its status must still arrive every time."""
    for run in range(REFUSAL_RUNS):
        call = rig.call()
        await send(call, hello())
        await send(call, snap(2, [1, 2, 3]))
        for seq in range(3, 13):
            await send(call, events(seq, stored(100 + seq)))
        await send(call, b"\xff\xff")
        got = await asyncio.wait_for(status_after_reading(call), STATUS_WITHIN_S)
        assert got == grpc.StatusCode.INVALID_ARGUMENT, f"run {run}: {got} {await call.details()!r}"
    assert rig.refused("malformed") == REFUSAL_RUNS


async def test_a_batch_with_a_malformed_event_is_refused_whole(rig: Rig) -> None:
    call = await establish(rig)
    before = rig.state()
    await send(call, events(3, stored(7, 8), pb.Event(), removed(1)))  # the second has no kind
    assert (
        await asyncio.wait_for(status_after_reading(call), STATUS_WITHIN_S)
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert "without a kind" in (await call.details() or "")
    assert rig.state() == before  # not even the stored event before it
