"""Stated invariants of the agent's subscriber, gateway stream and wiring (subscriber.py, gateway_client.py,
agent.py) no other test enforced, in-process (replay, gateway: stand-ins). More: test_invariants_sim_engine.py."""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Iterable
from functools import partial
from itertools import pairwise
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

import replica_agent.gateway_client as gwc
from gateway.asyncio_tasks import cancel_and_wait
from proto.kvgate.v1 import inventory_pb2 as pb
from replica_agent.agent import Agent, AgentConfig
from replica_agent.engine_events import BlockStored, EngineEvent
from replica_agent.gateway_client import GatewayClient, HelloInfo, Link, Sources
from replica_agent.inventory import AgentInventory
from replica_agent.outbox import Outbox
from replica_agent.subscriber import EventSubscriber
from tests.unit.test_agent_inventory import grouped
from tests.unit.test_agent_subscriber import stored as wire_stored
from tests.unit.test_invariants_agent import Engine

SEEDS = range(4)
B = 2  # tokens per engine block
CONFIG = AgentConfig("r0", "http://127.0.0.1:1", "tcp://127.0.0.1:2", "127.0.0.1:3", metrics_port=0)


class Trace(AgentInventory):
    """Records blocks (one a batch: hash 1000 * run + seq) applied since its last clear; 999_001 raises."""

    def __init__(self) -> None:
        self.since_clear, self.ever = list[Any](), set[Any]()
        super().__init__("m", B, max_blocks=100_000)

    def apply(self, events: Iterable[EngineEvent]) -> None:
        evs = list(events)
        assert not any(isinstance(ev, BlockStored) and 999_001 in ev.block_hashes for ev in evs), "a bug"
        self.since_clear += [h for ev in evs if isinstance(ev, BlockStored) for h in ev.block_hashes]
        self.ever.update(self.since_clear)
        super().apply(evs)

    def clear(self) -> None:
        self.since_clear = []
        super().clear()


class Source:
    """The engine: seq and clock, a bounded replay buffer, frames on their way to the agent."""

    def __init__(self, buffer: int) -> None:
        self.run, self.seq, self.ts = 0, 0, 1000.0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.flight, self.replay_up = list[list[bytes]](), True

    def publish(self) -> list[bytes]:
        self.ts, self.seq, seq = self.ts + 1.0, self.seq + 1, self.seq
        payload = msgpack.packb([self.ts, [wire_stored(1000 * self.run + seq, None, [seq % 3, 0])], 0])
        self.buffer.append((seq, payload))
        return [b"kv", seq.to_bytes(8, "big"), payload]

    def restart(self) -> None:
        self.run, self.seq = self.run + 1, 0
        self.buffer.clear()

    async def deliver_all(self, sub: EventSubscriber) -> None:
        while self.flight:
            await sub.handle_frames(self.flight.pop(0))


class Replayed(EventSubscriber):
    """Replay answered from ``source`` as vLLM does (buffered batches from ``start`` on; None: down)."""

    source: Source

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        src = self.source
        return [(s, p) for s, p in src.buffer if s >= start] if src.replay_up else None


def subscriber(inv: AgentInventory, src: Source) -> Replayed:
    (sub := Replayed(zmq.asyncio.Context.instance(), "inproc://events", "inproc://replay", inv)).source = src
    return sub


@pytest.mark.parametrize("seed", SEEDS)
async def test_subscriber_applies_in_order_gap_free_or_degrades(seed: int) -> None:
    """subscriber.py: in order, gap-free (a gap replayed, or clear and degrade); stale copies dropped;
    a restart clears; joining without replay of seq 0 degrades. Over lost, repeated, reordered, garbled
    frames, replay coming and going, a bounded buffer: the batches applied since the last clear are
    consecutive ones of one engine run, from its seq 0 (all, once delivered and probed) unless degraded."""
    rng = random.Random(seed)
    sub = subscriber(inv := Trace(), src := Source(rng.choice([4, 50])))
    _ = [src.publish() for _ in range(rng.randint(0, 6))]  # before the agent subscribed: in replay only
    src.flight += [src.publish() for _ in range(rng.randint(0, 2))]  # in the start's replay too
    await sub.catch_up()
    for _ in range(400):
        r = rng.random()
        if r < 0.4:
            frames, fate = src.publish(), rng.random()
            if fate < 0.05:
                src.flight.append([*frames[:2], b"\xc1garbled"])
            elif fate < 0.1:
                src.flight += [frames, frames]
            elif fate < 0.15 and src.flight:
                src.flight.insert(len(src.flight) - 1, frames)  # overtakes its predecessor
            elif not 0.15 <= fate < 0.22:
                src.flight.append(frames)  # (else lost)
        elif r < 0.75 and src.flight:
            frames, stale = src.flight.pop(0), sub.stats.stale
            await sub.handle_frames(frames)
            if sub.stats.stale > stale:  # dropped: applied already, or the inventory is incomplete
                assert 1000 * src.run + int.from_bytes(frames[1], "big") in inv.ever or inv.degraded
        elif r < 0.83:
            await sub.probe_tail()
        elif r < 0.88:
            src.replay_up = not src.replay_up
        elif r < 0.91:  # the engine restarts: its publisher disconnects, the agent rejoins
            await src.deliver_all(sub)
            sub.engine_gone()
            src.restart()
            _ = [src.publish() for _ in range(rng.randint(0, 2))]  # before it was subscribed to: replay only
            await sub.catch_up()
        elif r < 0.93 and sub.expected:  # a restart seen only by its first batch's seq going back
            await src.deliver_all(sub)
            src.restart()
            src.flight.append(src.publish())
            await src.deliver_all(sub)
        elif r >= 0.93:
            await src.deliver_all(sub)
            src.replay_up = True
            await sub.probe_tail()
            assert inv.degraded or inv.since_clear == [1000 * src.run + s for s in range(src.seq)]
        if got := inv.since_clear:
            seqs = [h % 1000 for h in got]
            assert len({h // 1000 for h in got}) == 1 and sub.expected == seqs[-1] + 1, got
            assert seqs == list(range(seqs[0], seqs[-1] + 1)) and (inv.degraded or seqs[0] == 0), got
    st = sub.stats
    assert st.recovered_gaps and st.stale and st.malformed_frames and st.engine_restarts


async def test_a_batch_that_never_decodes_leaves_the_inventory_degraded() -> None:
    """subscriber.py: a batch unreadable in the engine's replay copy too leaves the inventory
    cleared and degraded (found false: it was skipped, the inventory left complete)."""
    sub = subscriber(inv := Trace(), src := Source(50))
    await sub.handle_frames(src.publish())
    bad = [*src.publish()[:2], msgpack.packb("not a batch")]
    src.buffer[-1] = (1, bad[2])  # the engine's own copy is the same
    await sub.handle_frames(bad)
    await sub.handle_frames(src.publish())
    assert sub.stats.malformed_frames == 2 and sub.expected == 3 and inv.degraded


@pytest.mark.parametrize("seen", [0, 5])
@pytest.mark.parametrize(
    ("answer", "whole"),
    [(None, False), ([], True), ([0, 1, 2], True), ([0, 1, 2, 3, 4, 5], True), ([1, 2, 3], False),
     ([0, 1, 3, 4], False)],
)  # fmt: skip
async def test_catch_up_and_rekey_are_complete_only_from_seq_0_whole(
    answer: list[int] | None, whole: bool, seen: int
) -> None:
    """subscriber.py: ``catch_up`` is True when the buffer reached back to seq 0 and was applied whole (or
    nothing was published); a re-key stays degraded unless the buffer reached seq 0 and every batch seen."""
    sub = subscriber(inv := Trace(), src := Source(100))
    for _ in range(seen):
        await sub.handle_frames(src.publish())
    src.replay_up = answer is not None
    src.buffer.clear()
    for src.seq in answer or []:
        src.publish()
    assert await subscriber(Trace(), src).catch_up() is whole
    await sub.rekey(2 * B)
    assert inv.key_block_size == 2 * B and inv.degraded is not (whole and len(answer or []) >= seen)


class Burst(list[list[bytes]]):  # a SUB socket with frames queued
    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        assert flags == zmq.NOBLOCK  # never waits for more
        if not self:
            raise zmq.Again()
        return self.pop()


async def test_drain_yields_to_the_event_loop_every_256_frames() -> None:
    """subscriber.py ``_drain``: handles every queued frame, yielding to the event loop every 256
    frames (a flood cannot starve the gateway stream); an undecodable payload is counted and skipped;
    a frame whose handling raised leaves the inventory unknown: cleared and degraded."""
    rng, turns, src = random.Random(1), [0], Source(1)

    async def other_task() -> None:
        while True:
            turns[0] += 1
            await asyncio.sleep(0)

    sub, task = subscriber(inv := Trace(), src), asyncio.create_task(other_task())
    src.run, frames = 999, [[b"kv", bytes(8), rng.randbytes(rng.randint(0, 9))] for _ in range(1024)]
    await sub._drain(Burst([*frames, *reversed([src.publish(), src.publish()])]))  # type: ignore[arg-type]
    assert turns[0] >= 3 and sub.stats.frames == 1026 and sub.stats.internal_errors == 1
    assert inv.degraded and len(inv) == 0 and sub.stats.malformed_frames == 1024
    await cancel_and_wait(task)


def test_reconnect_backoff_is_capped_exponential_with_seeded_jitter() -> None:
    """gateway_client.py ``backoff``: exponential, capped, jitter in [50%, 100%] from the seeded generator."""
    link = Link("127.0.0.1:1", seed=7, backoff_initial_s=0.1, backoff_max_s=5.0)
    a, b = (GatewayClient(link, Sources(AgentInventory("m", B, 10), Outbox(), lambda: None)) for _ in "ab")
    r = [
        d / min(5.0, 0.1 * 2**n) for n in range(40) for _ in range(20) if (d := a.backoff(n)) == b.backoff(n)
    ]
    assert len(r) == 800 and 0.5 <= min(r) < 0.52 and 0.98 < max(r) <= 1.0


class Call:
    """The gateway end of a stream (and its channel): what the client writes, what it reads."""

    def __init__(self, *_args: object, **_kw: object) -> None:
        self.sent: list[pb.AgentMessage] = []
        self.inbox: asyncio.Queue[pb.GatewayMessage] = asyncio.Queue()
        self.log: list[str] = []

    async def write(self, msg: pb.AgentMessage) -> None:
        self.sent.append(msg)
        await asyncio.sleep(0)  # a write lets others run, as a real one may

    async def read(self) -> pb.GatewayMessage:
        try:
            return await self.inbox.get()
        except asyncio.CancelledError:
            self.log.append("reader cancelled")
            raise

    def cancel(self) -> bool:
        self.log.append("call cancelled")
        return True

    async def __aenter__(self) -> Call:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self.log.append("channel closed")

    def stream_stream(self, *_args: object, **_kw: object) -> Any:
        return lambda **_call_kw: self


async def quiet(outbox: Outbox) -> None:
    idle = turns = 0
    while idle < 8 and (turns := turns + 1) < 50_000:  # (bounds a client that never goes quiet)
        idle = 0 if outbox.events or outbox.need_snapshot or outbox.wake.is_set() else idle + 1
        await asyncio.sleep(0)


async def session(inv: AgentInventory, outbox: Outbox, **sources: Any) -> tuple[Call, asyncio.Task[bool]]:
    hello, call = HelloInfo("r0", "http://127.0.0.1:1", ["m"], B, 0, "vllm", "0"), Call()
    client = GatewayClient(Link("gw:1", flush_interval_s=0), Sources(inv, outbox, lambda: hello, **sources))
    client._channel = lambda: call  # type: ignore[method-assign]
    await call.inbox.put(pb.GatewayMessage(ack=pb.Ack(seq=1)))
    task = asyncio.create_task(client._session(hello))
    await asyncio.wait_for(client.connected.wait(), 5)
    await quiet(outbox)
    return call, task


def gateway_view(sent: list[pb.AgentMessage], lost: list[int]) -> set[int]:
    """The gateway's keys after ``sent`` (lost at ``lost``); the shape: seq 1, 2, ...; Hello, snapshot."""
    kinds = [m.WhichOneof("body") for m in sent]
    assert [m.seq for m in sent] == list(range(1, len(sent) + 1))
    assert kinds[:2] == ["hello", "snapshot"] and "hello" not in kinds[1:]
    view, building = set[int](), None
    for i, (m, kind) in enumerate(zip(sent, kinds, strict=True)):
        view = {-1} if i in lost else view
        if kind == "snapshot":
            building = (building or set()) | set(m.snapshot.keys)
            if m.snapshot.last:
                view, building = building, None
        else:
            assert building is None, kinds
        for ev in m.events.events if kind == "events" else ():
            keys = set(ev.stored.keys) | set(ev.removed.keys)  # (one of them is empty)
            view = set() if ev.HasField("cleared") else view | keys if ev.HasField("stored") else view - keys
    return view


@pytest.mark.parametrize("seed", SEEDS)
async def test_stream_is_hello_snapshot_then_deltas_summing_to_the_inventory(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gateway_client.py: a stream sends Hello, a full snapshot, deltas, the state when it changes (never
    twice the same); on Resync a fresh snapshot; deltas queued from the snapshot's copy on follow it: the
    gateway's view is the inventory. Shutdown: the reader task is cancelled, the call, the channel closed."""
    monkeypatch.setattr(gwc, "SNAPSHOT_CHUNK", 3)
    eng, outbox = Engine(rng := random.Random(seed)), Outbox(max_events=8)
    inv = AgentInventory("m", B, max_blocks=12, sink=outbox)
    inv.apply([eng.plain() for _ in range(20)])  # before the stream: in its first snapshot
    call, task = await session(inv, outbox, state=lambda: pb.AgentState(degraded=inv.degraded))
    lost: list[int] = []
    for step in range(300):
        if rng.random() < 0.9:
            inv.apply([eng.plain() for _ in range(rng.choice([1, 1, 1, 1, 12]))])  # some overflow
        else:
            lost.append(len(call.sent))
            await call.inbox.put(pb.GatewayMessage(resync=pb.Resync(reason="lost")))
        for _ in range(rng.randint(0, 3)):
            await asyncio.sleep(0)
        if step % 30 == 29:
            await quiet(outbox)
            assert gateway_view(call.sent, lost) == set(inv.snapshot())
    states = [m.state.degraded for m in call.sent if m.WhichOneof("body") == "state"]
    assert all(a != b for a, b in pairwise(states)) and states[-1] == inv.degraded
    assert sum(m.snapshot.last for m in call.sent) > 2 and outbox.overflows > 0
    await cancel_and_wait(task)
    assert call.log == ["reader cancelled", "call cancelled", "channel closed"]


async def test_the_hybrid_flag_reaches_the_gateway_before_the_keys() -> None:
    """gateway_client.py: the engine's hybrid flag goes before the first snapshot too (found
    false: the stream's first snapshot went out before its first EngineState)."""
    inv, t = AgentInventory("m", B, max_blocks=100, sink=(outbox := Outbox())), [1, 2, 3, 4, 5, 6]
    inv.apply([grouped([10, 11, 12], None, t, group=0), grouped([11, 12], None, t, group=1, window=4)])
    assert inv.hybrid and len(inv) > 0
    call, task = await session(inv, outbox, engine=lambda: pb.EngineState(hybrid=inv.hybrid))
    await cancel_and_wait(task)
    kinds = [m.WhichOneof("body") for m in call.sent]
    assert kinds.index("engine") < kinds.index("snapshot")


@pytest.mark.parametrize(
    "last",
    ["http closed"],
)  # fmt: skip
async def test_agent_stops_the_stream_then_the_probe_then_the_subscriber(
    last: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """agent.py: stopped in this order when ``stop`` is set: the gateway stream, the load probe, the
    event subscriber; then the ZMQ context, the metrics endpoint and the HTTP session are closed."""
    order: list[str] = []

    async def forever(name: str, *_args: object) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            order.append(name)

    class Closed(Call):  # the ZMQ context (destroyed) and the HTTP session (a context manager)
        def destroy(self, linger: int) -> None:
            order.append(f"zmq, linger {linger}")

        async def __aexit__(self, *_exc: object) -> None:
            order.append("http closed")

        async def cleanup(self) -> None:
            order.append("metrics")

    for owner, name, fn in [(Agent, "_discover", lambda *_: asyncio.sleep(0, "m")),
                            (Agent, "_probe", partial(forever, "probe")), (GatewayClient, "run", partial(forever, "gw")),
                            (Agent, "_watch_models", partial(forever, "models")), (zmq.asyncio, "Context", Closed),
                            (EventSubscriber, "run", partial(forever, "sub")), (aiohttp, "ClientSession", Closed),
                            (Agent, "_serve_metrics", lambda *_: asyncio.sleep(0, Closed()))]:  # fmt: skip
        monkeypatch.setattr(owner, name, fn)
    run = asyncio.create_task((agent := Agent(CONFIG)).run(stop := asyncio.Event()))
    await asyncio.wait_for(agent.ready.wait(), 5)  # (its tasks started by then)
    stop.set()
    await asyncio.wait_for(run, 5)
    assert order[:5] == ["gw", "probe", "sub", "models", "zmq, linger 0"] and len(order) == 7
    assert order[-1] == last  # (the other one of "metrics", "http closed" before it)


async def test_the_hello_waits_for_a_rekey_to_the_gateways_block_size() -> None:
    """agent.py: re-key at the gateway's block size when the engine's block divides it (not when
    already there, nor at a size the engine cannot be keyed at); the hello waits for the new keys."""
    agent = Agent(CONFIG)
    inv = agent.inventory = AgentInventory("m", B, 100)
    sub = agent.subscriber = EventSubscriber(zmq.asyncio.Context.instance(), "inproc://e", None, inv)
    assert not agent._gateway_block_size(B) and not agent._gateway_block_size(3 * B + 1)
    assert not sub.rekey_pending and (hello := agent._hello()) is not None and hello.block_size == B
    assert agent._gateway_block_size(4 * B) and sub.rekey_pending and agent._hello() is None
    await sub.rekey(4 * B)
    sub._rekey = None  # as the run loop does once it has re-keyed
    assert (hello := agent._hello()) is not None and hello.block_size == 4 * B
