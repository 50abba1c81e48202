"""The event subscriber against a real ZMQ publisher (PUB + replay ROUTER, vLLM's protocol) run by
the test: in-order apply, gaps recovered by replay, unrecoverable gaps, engine restarts,
duplicates and reordering, malformed payloads, joining late."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio

from gateway.asyncio_tasks import cancel_and_wait
from replica_agent.inventory import AgentInventory
from replica_agent.subscriber import EventSubscriber
from router_policies.block_keys import block_keys
from tests.polling import until
from tests.zmq_publisher import Publisher

BS = 2


@pytest.fixture
async def pub() -> AsyncIterator[Publisher]:
    ctx = zmq.asyncio.Context()
    publisher = Publisher(ctx)
    try:
        yield publisher
    finally:
        await publisher.close()
        ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def running(sub: EventSubscriber) -> AsyncIterator[None]:
    """``sub.run()`` as a task for the block's duration."""
    task = asyncio.create_task(sub.run())
    try:
        yield
    finally:
        await cancel_and_wait(task)


def stored(h: int, parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [h],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def removed(h: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"}


def key(*tokens: int) -> int:
    return block_keys(list(tokens), BS, "m")[-1]


async def wait_for(cond: Callable[[], bool]) -> None:
    await until(cond, timeout_s=5.0, interval_s=0.01)  # a deadline against hanging


class Rig:
    def __init__(self, pub: Publisher, sub: EventSubscriber, inv: AgentInventory) -> None:
        self.pub, self.sub, self.inv = pub, sub, inv

    async def synced(self) -> None:
        """Wait until the subscriber has applied everything published."""
        await wait_for(lambda: self.sub.expected == self.pub.seq)


@pytest.fixture
async def rig(pub: Publisher) -> AsyncIterator[Rig]:
    inv = AgentInventory("m", BS, max_blocks=1000)
    sub = pub.subscriber(inv, replay_timeout_s=2.0)
    async with running(sub):
        await pub.joined()
        yield Rig(pub, sub, inv)


async def test_in_order(rig: Rig) -> None:
    await rig.pub.publish([stored(1, None, [1, 2])])
    await rig.pub.publish([stored(2, 1, [3, 4]), stored(3, None, [9, 9])])
    await rig.pub.publish([removed(3)])
    await rig.synced()
    assert sorted(rig.inv.keys()) == sorted([key(1, 2), key(1, 2, 3, 4)])
    assert rig.sub.stats.gaps == 0 and not rig.inv.degraded


async def test_gap_recovered_by_replay(rig: Rig) -> None:
    await rig.pub.publish([stored(1, None, [1, 2])])
    rig.pub.batch([stored(2, 1, [3, 4])])  # published but lost on the way
    rig.pub.batch([stored(3, 2, [5, 6])])
    await rig.pub.publish([stored(4, 3, [7, 8])])
    await rig.synced()
    assert sorted(rig.inv.keys()) == sorted(block_keys([1, 2, 3, 4, 5, 6, 7, 8], BS, "m"))
    assert rig.sub.stats.gaps == 1 and rig.sub.stats.recovered_gaps == 1
    assert rig.sub.stats.replayed_batches == 2
    assert not rig.inv.degraded


async def test_a_lost_tail_is_replayed_once_the_stream_is_quiet(rig: Rig) -> None:
    """The last batches are lost and the engine publishes nothing more, so no later seq shows the
    gap (as when they went out before our subscription reached the PUB socket): replay supplies
    them after ``tail_probe_s`` of quiet."""
    await rig.pub.publish([stored(1, None, [1, 2])])
    await rig.synced()
    probes = rig.sub.stats.tail_probes
    rig.pub.batch([stored(2, 1, [3, 4])])  # lost on the way, and nothing follows
    rig.pub.batch([stored(3, 2, [5, 6])])
    await rig.synced()
    assert sorted(rig.inv.keys()) == sorted(block_keys([1, 2, 3, 4, 5, 6], BS, "m"))
    assert rig.sub.stats.gaps == 1 and rig.sub.stats.recovered_gaps == 1
    assert rig.sub.stats.tail_probes > probes and not rig.inv.degraded


async def test_a_quiet_stream_probes_once(rig: Rig) -> None:
    """A probe that finds nothing new owes no other: an idle engine is not polled."""
    await rig.pub.publish([stored(1, None, [1, 2])])
    await rig.synced()
    await wait_for(lambda: rig.sub._probe_due is None)  # the probe owed after that batch ran
    probes = rig.sub.stats.tail_probes
    assert probes >= 1
    await asyncio.sleep(3 * rig.sub.tail_probe_s)
    assert rig.sub.stats.tail_probes == probes and rig.sub.stats.gaps == 0


def probed(sub: EventSubscriber, probes: int) -> bool:
    """``probes`` tail probes done, and none owed."""
    return sub.stats.tail_probes == probes and sub._probe_due is None


async def test_replay_keeps_its_connection_after_a_clean_answer_only(pub: Publisher) -> None:
    """engine_replay.py ``keep``: the start-up replay and the tail probes after it ask through
    one DEALER socket; an ask left unanswered (timed out: its answer may still come) closes it,
    and the next ask opens another."""
    inv = AgentInventory("m", BS, max_blocks=1000)
    sub = pub.subscriber(inv, replay_timeout_s=0.3, tail_probe_s=0.05)
    async with running(sub):
        await pub.joined()
        for i in range(3):  # each batch owes a tail probe once the stream is quiet
            await pub.publish([stored(10 + i, None, [i, i])])
            await wait_for(functools.partial(probed, sub, i + 1))
        assert len(pub.askers) == 4 and len(set(pub.askers)) == 1  # catch-up and three probes
        pub.mute = 1
        await pub.publish([stored(20, None, [5, 5])])
        await wait_for(functools.partial(probed, sub, 4))  # timed out
        await pub.publish([stored(21, None, [6, 6])])
        await wait_for(functools.partial(probed, sub, 5))
        assert len(pub.askers) == 6 and pub.askers[4] == pub.askers[0] != pub.askers[5]
        assert sub.expected == pub.seq and not inv.degraded


async def test_an_idle_subscriber_wakes_for_a_batch_and_for_a_rekey(rig: Rig) -> None:
    """subscriber.py ``run``: idle (no tail probe owed, so it waits on its sockets with no
    timeout), it still applies the next batch, and a re-key asked from another task wakes it."""
    await rig.pub.publish([stored(1, None, [1, 2])])
    await rig.synced()
    await wait_for(lambda: rig.sub._probe_due is None)
    await asyncio.sleep(0.3)  # idle: nothing owed, nothing published
    await rig.pub.publish([stored(2, 1, [3, 4])])
    await rig.synced()
    assert sorted(rig.inv.keys()) == sorted(block_keys([1, 2, 3, 4], BS, "m"))
    await wait_for(lambda: rig.sub._probe_due is None)
    rig.sub.request_rekey(2 * BS)
    await wait_for(lambda: not rig.sub.rekey_pending and rig.inv.key_block_size == 2 * BS)
    assert rig.inv.keys() == [block_keys([1, 2, 3, 4], 2 * BS, "m")[-1]]


async def test_unrecoverable_gap_clears_and_degrades(rig: Rig) -> None:
    await rig.pub.publish([stored(1, None, [1, 2])])
    await rig.synced()
    for _ in range(3):
        rig.pub.batch([stored(50, None, [7, 7])])
    rig.pub.buffer.clear()  # the replay buffer no longer reaches back
    await rig.pub.publish([stored(2, 1, [3, 4]), stored(5, None, [5, 5])])
    await rig.synced()
    assert rig.sub.stats.unrecovered_gaps == 1
    assert rig.inv.degraded
    assert rig.inv.keys() == [key(5, 5)]  # the child of an unknown parent is skipped
    assert rig.inv.stats.skipped_blocks == 1


async def test_engine_restart_clears(rig: Rig) -> None:
    for i in range(5):
        await rig.pub.publish([stored(10 + i, None, [i, i])])
    await rig.synced()
    assert len(rig.inv) == 5
    rig.pub.restart()
    await rig.pub.publish([stored(1, None, [1, 2])])
    await wait_for(lambda: rig.sub.stats.engine_restarts == 1)
    await rig.synced()
    assert rig.inv.keys() == [key(1, 2)]
    assert not rig.inv.degraded


async def test_engine_restart_with_missed_first_batches_recovers_from_replay(rig: Rig) -> None:
    for i in range(5):
        await rig.pub.publish([stored(10 + i, None, [i, i])])
    await rig.synced()
    rig.pub.restart()
    rig.pub.batch([stored(1, None, [1, 2])])  # missed while the SUB reconnected
    await rig.pub.publish([stored(2, 1, [3, 4])])
    await rig.synced()
    assert sorted(rig.inv.keys()) == sorted(block_keys([1, 2, 3, 4], BS, "m"))
    assert rig.sub.stats.engine_restarts == 1


async def test_duplicates_and_reordering(rig: Rig) -> None:
    seq0, p0 = await rig.pub.publish([stored(1, None, [1, 2])])
    await rig.pub.send(seq0, p0)  # duplicate
    s1, p1 = rig.pub.batch([stored(2, 1, [3, 4])])
    s2, p2 = rig.pub.batch([removed(2)])
    await rig.pub.send(s2, p2)  # arrives before its predecessor: recovered through replay
    await rig.pub.send(s1, p1)  # the late one is stale
    s3, _p3 = await rig.pub.publish([stored(3, 1, [5, 6])])
    await wait_for(lambda: rig.sub.expected == s3 + 1)
    assert sorted(rig.inv.keys()) == sorted([key(1, 2), key(1, 2, 5, 6)])
    assert rig.sub.stats.stale == 2
    assert rig.sub.stats.recovered_gaps == 1


async def test_malformed_payloads_are_skipped(rig: Rig) -> None:
    await rig.pub.publish([stored(1, None, [1, 2])])
    await rig.pub.pub.send_multipart([b"kv", b"short"])
    await rig.pub.pub.send_multipart([b"kv", b"\x00\x01", b""])
    await rig.pub.publish([stored(2, 1, [3, 4]), {"type": "BlockStored"}])
    await rig.synced()
    assert sorted(rig.inv.keys()) == sorted(block_keys([1, 2, 3, 4], BS, "m"))
    assert rig.sub.stats.malformed_frames == 2
    assert rig.sub.stats.malformed_events == 1
    assert not rig.inv.degraded


async def test_a_garbled_batch_is_replayed_whole(rig: Rig) -> None:
    """A batch corrupted on the way (the engine's replay buffer holds it intact) is not counted as
    received: the next batch shows the gap and replay supplies it, removals included."""
    await rig.pub.publish([stored(1, None, [1, 2]), stored(2, 1, [3, 4])])
    seq, _payload = rig.pub.batch([removed(2), stored(3, 1, [5, 6])])
    await rig.pub.send(seq, b"\xc1garbage")
    await rig.pub.publish([stored(4, 3, [7, 8])])
    await rig.synced()
    assert sorted(rig.inv.keys()) == sorted([key(1, 2), key(1, 2, 5, 6), key(1, 2, 5, 6, 7, 8)])
    assert rig.sub.stats.malformed_frames == 1 and not rig.inv.degraded


async def test_a_garbled_batch_replay_cannot_supply_leaves_the_inventory_degraded(rig: Rig) -> None:
    await rig.pub.publish([stored(1, None, [1, 2])])
    await rig.pub.pub.send_multipart([b"kv", rig.pub.seq.to_bytes(8, "big"), b"\xc1garbage"])
    rig.pub.seq += 1  # never in the replay buffer
    await rig.pub.publish([stored(2, None, [3, 4])])
    await rig.synced()
    assert rig.sub.stats.malformed_frames == 1
    assert rig.inv.degraded  # the unread batch may have removed blocks: not silently complete


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
async def test_joining_late(pub: Publisher, replay: bool) -> None:
    """Batches published before the agent subscribed: recovered by replaying from seq 0, or,
    without a replay endpoint, missed and the inventory marked degraded."""
    for i in range(3):
        pub.batch([stored(10 + i, None, [i, i])])  # before the agent subscribed
    inv = AgentInventory("m", BS, max_blocks=100)
    sub = pub.subscriber(inv, replay=replay)
    async with running(sub):
        await pub.joined(replay)
        await pub.publish([stored(20, None, [9, 9])])
        await wait_for(lambda: sub.expected == pub.seq)
    early = [key(i, i) for i in range(3)] if replay else []
    assert sorted(inv.keys()) == sorted([*early, key(9, 9)])
    assert inv.degraded is not replay


async def test_publisher_disconnect_clears_at_once(pub: Publisher) -> None:
    """The engine process went away: its cache is gone before any new batch says so."""
    inv = AgentInventory("m", BS, max_blocks=100)
    sub = pub.subscriber(inv, replay=False)
    async with running(sub):
        await pub.joined(replay=False)
        await pub.publish([stored(1, None, [1, 2])])
        await pub.publish([stored(2, 1, [3, 4])])
        await wait_for(lambda: len(inv) == 2)
        await pub.close()
        await wait_for(lambda: sub.stats.engine_disconnects == 1)
        assert len(inv) == 0 and not inv.degraded and sub.expected is None


async def test_replay_answer_is_bounded(pub: Publisher) -> None:
    """A replay longer than max_replay_batches is abandoned: the gap counts as unrecoverable."""
    inv = AgentInventory("m", BS, max_blocks=100)
    sub = pub.subscriber(inv, max_replay_batches=5)
    async with running(sub):
        await pub.joined()
        await pub.publish([stored(1, None, [1, 2])])
        await wait_for(lambda: sub.expected == 1)
        for i in range(20):
            pub.batch([stored(100 + i, None, [i, i])])
        await pub.publish([stored(2, None, [3, 3])])
        await wait_for(lambda: sub.expected == pub.seq)
        assert sub.stats.unrecovered_gaps == 1 and inv.degraded
        assert inv.keys() == [key(3, 3)]


async def test_unreachable_replay_endpoint_does_not_stall(pub: Publisher) -> None:
    """A replay endpoint nobody listens on: the start-up catch-up and a gap give up after the
    timeout, the gap counts as unrecoverable, and live events keep flowing."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    inv = AgentInventory("m", BS, max_blocks=100)
    sub = pub.subscriber(inv, replay=dead, replay_timeout_s=0.3)
    async with running(sub):
        await asyncio.sleep(0.6)
        await pub.publish([stored(1, None, [1, 2])])
        pub.batch([stored(2, 1, [3, 4])])  # lost
        await pub.publish([stored(3, None, [5, 6])])
        await wait_for(lambda: sub.expected == pub.seq)
        assert sub.stats.unrecovered_gaps == 1
        assert inv.keys() == [key(5, 6)]
