"""The stated invariants of the gateway's state modules (inventory stream and ops, shared state,
the workers' hub, the health machine), checked after every step of seeded random runs, in process:
fakes stand for Redis and the workers' sockets. Those found false are ``xfail(strict)``."""

from __future__ import annotations

import ast
import asyncio
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from gateway import inventory_ops
from gateway import shared_state_codec as codec
from gateway.config import GatewayConfig, HealthConfig, SharedStateConfig, parse_config
from gateway.fleet import Fleet
from gateway.inventory_ops import BoundCheck, BoundExceeded, IndexReplica, Op, Staging, apply_ops, stored_keys
from gateway.inventory_refusals import Refusal
from gateway.inventory_server import InventoryServer, _ack_pause, _next_message
from gateway.inventory_sink import AgentEngine, AgentHello, AgentLoad
from gateway.inventory_stream import StreamState
from gateway.local_hub import Hub, HubHooks, OwnerFleet, frame_bound
from gateway.local_hub_codec import decode_json
from gateway.replica_health import ReplicaHealth
from gateway.shared_state_context import SharedContext
from gateway.shared_state_follower import Follower, _Follow
from gateway.shared_state_load import _add_queue, decode_queue
from gateway.shared_state_metrics import SharedStateMetrics
from gateway.shared_state_publisher import Publisher
from kvgate_tools.stream_agent import events, hello, removed, snap
from proto.kvgate.v1 import inventory_pb2 as pb
from router_policies.prefix_index import IndexBoundError, IndexConfig, PrefixIndex


def _config(replicas: tuple[str, ...] = ("r0", "r1"), **extra: Any) -> GatewayConfig:
    reps = [{"id": r, "url": "http://127.0.0.1:9", "models": ["m"]} for r in replicas]
    tree = {
        "models": [{"name": "m", "block_size": 16}],
        "replicas": reps,
        "inventory": {"allow_registration": False},
    }
    return parse_config(tree | extra)


def _hello(rid: str) -> AgentHello:
    return AgentHello(rid, f"http://{rid}:8000", ("m",), 16, 100, "vllm", "0.1", "1")


def _health_walk(seed: int) -> Iterator[tuple[ReplicaHealth, float, float, bool]]:
    """(health, now, ejected_until before the step, whether a check made it healthy) after each
    step of a random run."""
    rng = random.Random(seed)
    cfg = HealthConfig(unhealthy_after=rng.randint(1, 3), healthy_after=rng.randint(1, 3), ejection_s=5.0)
    h, now = ReplicaHealth(), 0.0
    for _ in range(40):
        now, before, was, op = now + rng.uniform(0.0, 3.0), h.ejected_until, h.healthy, rng.randrange(9)
        if op in (0, 4, 5):
            h.check_result(rng.random() < 0.6, "e", cfg, now)
        elif op in (3, 6, 7):  # a request answered; a reload's new address; an agent's Hello
            {3: h.proxy_success, 6: h.unknown, 7: h.assume_healthy}[op]()
        else:
            h.proxy_failure("e", op == 2, cfg, now)
        yield h, now, before, op in (0, 4, 5) and h.healthy and not was


def test_health_streaks_exclude_each_other_and_only_an_ejection_sets_a_future_time() -> None:
    for seed in range(300):
        for h, now, before, restored in _health_walk(seed):
            assert not (h.ok_streak and h.fail_streak), seed
            if h.ejected_until > before:
                assert h.ejected_until > now and not h.healthy, seed
            assert not restored or now >= h.ejected_until, seed  # no check lifts an ejection early


def test_unhealthy_since_is_set_iff_checked_and_unhealthy() -> None:
    """replica_health.py: found false when a failed request was an unchecked replica's first
    result (checked, unhealthy, no time: ``forget_stale`` never forgot it)."""
    for seed in range(300):
        for h, _, _, _ in _health_walk(seed):
            assert (h.unhealthy_since is not None) == (h.checked and not h.healthy), seed


def test_every_target_agrees_and_the_counts_survive_a_bound_error() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        index = PrefixIndex(IndexConfig(max_blocks_per_replica=25))
        index.add_replica("r")
        target, staging, counts = IndexReplica(index, "r"), Staging(1, bound=10**6), [0, 0, 0]
        for _ in range(60):
            keys = rng.sample(range(40), rng.randint(0, 12))
            op = rng.choice([Op("s", keys, "CPU"), Op("s", keys), Op("r", keys), Op("c")])
            before, check = index.precise_entries("r"), BoundCheck.of(index, "r", 25)
            try:
                apply_ops([op], check)
            except BoundExceeded:
                with pytest.raises(IndexBoundError):  # the index refuses it too, changing nothing
                    apply_ops([op], target)
                assert index.precise_entries("r") == before, seed
                continue
            apply_ops([op], target)
            apply_ops([op], staging)
            assert index.precise_entries("r") == staging.entries, seed  # keys and first media
            assert index.precise_count("r") - len(before) <= stored_keys([op]), seed
            counts[0] += len(op.keys) if op.kind == "s" else 0
            counts[1] += len(set(op.keys) & before.keys()) if op.kind == "r" else 0
            counts[2] += op.kind == "c"
            assert [target.stored, target.removed, target.cleared] == counts, seed


def _message(rng: random.Random, seq: int) -> pb.AgentMessage:
    if rng.random() < 0.35:
        return snap(seq, rng.sample(range(150), rng.randint(0, 40)), rng.randint(1, 3), rng.random() < 0.5)
    evs = [pb.Event(stored=pb.Stored(keys=rng.sample(range(150), rng.randint(0, 30)))) for _ in range(3)]
    evs += [removed(*rng.sample(range(150), 20)), pb.Event(cleared=pb.Cleared()), pb.Event()]
    evs[0].stored.medium = "CPU"
    return events(seq, *rng.choices(evs, [3, 3, 3, 3, 1, 0.2], k=rng.randint(1, 4)))


def _inventory(index: PrefixIndex) -> tuple[dict[str, dict[int, str]], int]:
    return {r: index.precise_entries(r) for r in index.replicas}, index.entries


def test_streams_apply_whole_within_the_bound_and_only_on_a_snapshot() -> None:
    for seed in range(30):
        rng = random.Random(seed)
        index = PrefixIndex(IndexConfig(max_blocks_per_replica=60, max_total_blocks=100))
        fleet = Fleet(_config(), index)
        server = InventoryServer(index, fleet, token=None, registry=CollectorRegistry())
        streams: dict[str, StreamState] = {}
        for _ in range(150):
            rid = rng.choice(("r0", "r1"))
            old = streams.get(rid)
            if old is None or rng.random() < 0.03:
                s, cap = StreamState(peer="p", task=None), rng.randint(2, 30)
                server._handle(s, hello(rid, capacity=cap).SerializeToString())
                assert server._streams.writers[rid] is s and s.bound == min(60, 4 * cap), seed
                if old is not None:  # superseded: its end leaves the replica to the new stream
                    server._streams.release(old)
                    assert old.superseded and fleet.has_agent(rid), seed
                streams[rid] = s
            s = streams[rid]
            msg, before, synced = (
                _message(rng, s.expected_seq + (rng.random() < 0.03)),
                _inventory(index),
                s.synced,
            )
            try:
                server._handle(s, msg.SerializeToString())
            except Refusal:
                assert _inventory(index) == before, seed  # whole or not at all
                server._streams.release(streams.pop(rid))
                assert _inventory(index) == before and not fleet.has_agent(rid), seed  # entries stay
                continue
            if msg.WhichOneof("body") == "events" and not synced:  # ignored, or staged
                assert _inventory(index) == before, seed
            if s.synced:
                assert index.precise_count(rid) <= s.bound <= 60, seed


async def test_a_hint_or_the_end_cuts_the_ack_pause_short_and_a_resync_goes_first() -> None:
    for cut in ("hint", "end"):
        s = StreamState(peer="p", task=None, ack_seq=2)
        pause = asyncio.create_task(_ack_pause(s, asyncio.get_running_loop().time() + 30.0))
        for seq in (3, 4):  # acks owed meanwhile replace the one waiting: the pause goes on
            await asyncio.sleep(0.01)
            s.ack_seq = seq
            s.wake.set()
        await asyncio.sleep(0.01)
        assert not pause.done()
        s.closing = cut == "end"
        s.held.extend([pb.HeldPrefix(keys=[1])] if cut == "hint" else [])
        s.wake.set()
        await asyncio.wait_for(pause, 1.0)
    s.resync_reason = "gap"
    s.held.append(pb.HeldPrefix(keys=[1]))
    assert [m.WhichOneof("body") for m in iter(lambda: _next_message(s), None)] == ["resync", "ack", "held"]


class _Agents:
    def __init__(self, *connected: str) -> None:
        self.connected, self.resyncs = list(connected), list[str]()

    def connected_replicas(self) -> list[str]:
        return list(self.connected)

    def request_resync(self, replica: str, reason: str = "admin") -> bool:
        self.resyncs.append(replica)
        return bool(reason)


def _ctx(**cfg: Any) -> SharedContext:
    config = SharedStateConfig(redis_url="redis://unused", **cfg)
    return SharedContext(config, SharedStateMetrics(CollectorRegistry()), "a", up=True)


def test_publisher_queue_counters_and_snapshot_refresh() -> None:
    for seed in range(20):
        rng = random.Random(seed)
        ctx, agents, owned = _ctx(publish_queue=8, stream_maxlen=16), _Agents(), list[str]()
        pub, seen, evicted = Publisher(ctx, agents, 8, owned.append), dict[str, set[int]](), 0
        since, mark = dict[str, int](), dict[str, int]()  # deltas, len(resyncs) since its snapshot
        for _ in range(300):
            rid, roll, queued = rng.choice(("r0", "r1", "r2")), rng.random(), list(pub._queue)
            if roll < 0.1:
                pub.inventory_hello(_hello(rid))
                assert owned[-1] == rid  # told synchronously
            elif roll < 0.2:
                since[rid], mark[rid] = 0, len(agents.resyncs)
                pub.inventory_snapshot(rid, dict.fromkeys(range(rng.randint(0, 5)), "GPU"))
            else:
                pub.inventory_ops(rid, [Op("s", [rng.randrange(100)])])
                since[rid] = since.get(rid, 0) + 1
                if since[rid] >= 16 // 2:  # stream_maxlen // 2 deltas: a fresh snapshot asked
                    assert rid in agents.resyncs[mark.get(rid, 0) :], seed
            assert len(pub._queue) <= 8, seed
            now = {id(p) for p in pub._queue}
            for p in (p for p in queued if id(p) not in now):  # dropped: its replica asked to heal
                evicted += 1
                assert p.replica in agents.resyncs[mark.get(p.replica, 0) :], seed
            for p in pub._queue:
                seen.setdefault(p.replica, set()).add(p.n)
            if rng.random() < 0.1:
                pub._queue.clear()  # the publish loop sent them
        assert all(ns == set(range(1, max(ns) + 1)) for ns in seen.values()), seed  # n: +1 each
        assert ctx.metrics.dropped.labels("queue_full")._value.get() == evicted


def test_publisher_tables_stay_bounded_as_replicas_come_and_go() -> None:
    """shared_state_publisher.py: the per-replica tables stay within max_replicas as replicas
    come and go, and each new one's Hello is published (found false: after max_replicas ids had
    said Hello, a new replica's registration was never published)."""
    pub = Publisher(_ctx(), _Agents(), 2, lambda _r: None)
    for i in range(6):  # one replica at a time: never more than max_replicas at once
        pub.inventory_hello(_hello(f"pod-{i}"))
        pub.inventory_snapshot(f"pod-{i}", {})
        pub.inventory_ops(f"pod-{i}", [Op("s", [i])])
        assert any(p.kind == "hello" and p.replica == f"pod-{i}" for p in pub._queue), i
        assert max(len(pub._seq), len(pub._since_snapshot), len(pub._hellos)) <= 2


class _Redis:
    def __init__(self) -> None:
        self.hashes: dict[str, dict[bytes, bytes]] = {}
        self.during: Callable[[], None] = lambda: None  # runs inside hgetall's await

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        self.during()
        return dict(self.hashes.get(key, {}))


def _snap_hash(pos: int, n: int, keys: list[int]) -> dict[bytes, bytes]:
    payload = codec.encode_snapshot(dict.fromkeys(keys, "GPU"))
    return {b"id": b"%d-0" % pos, b"n": b"%d" % n, b"o": b"a", b"p": payload}


def _entry(pos: int, kind: bytes, n: int) -> tuple[bytes, dict[bytes, bytes]]:
    head = codec.encode_header(codec.Header(kind, n, 0.0, b"a"))
    return b"%d-0" % pos, {b"h": head, b"p": codec.encode_ops([Op("s", [n])])}


async def _following() -> tuple[Follower, PrefixIndex, _Redis]:
    index, ctx, client = PrefixIndex(), _ctx(), _Redis()
    follower = Follower(ctx, index, Fleet(_config(), index), _Agents())
    client.hashes[ctx.keys.snapshot("r0")] = _snap_hash(1, 1, [])
    follower._follow["r0"] = follow = _Follow()  # as _discover starts following a registered replica
    await follower._reload(cast(Any, client), "r0", follow, "bootstrap")
    assert follower.following() == ["r0"]
    return follower, index, client


async def test_follower_applies_deltas_only_on_an_unbroken_base() -> None:
    for seed in range(20):
        rng = random.Random(seed)
        follower, index, client = await _following()
        snap_key, n, pos, deltas = follower.ctx.keys.snapshot("r0"), 1, 1, list[int]()
        for _ in range(40):
            batch = []
            for _ in range(rng.randint(1, 6)):
                n, fate, is_snap = n + 1, rng.random(), rng.random() < 0.15
                if not is_snap:
                    deltas.append(n)  # the owner applied it: its key is n
                if fate < 0.1:
                    continue  # dropped from the owner's queue: never in Redis
                pos += 1
                if is_snap:
                    client.hashes[snap_key] = _snap_hash(pos, n, deltas)
                if fate > 0.2:  # else trimmed from the stream before the follower read it
                    batch.append(_entry(pos, b"S" if is_snap else b"d", n))
            await follower._apply_entries(cast(Any, client), "r0", batch)
            got = sorted(index.precise_keys("r0"))
            assert got == deltas[: len(got)], seed  # the owner's state after some entry
        client.hashes[snap_key] = _snap_hash(pos + 1, n + 1, deltas)
        await follower._apply_entries(cast(Any, client), "r0", [_entry(pos + 1, b"S", n + 1)])
        assert sorted(index.precise_keys("r0")) == deltas, seed


async def test_follower_applies_nothing_to_a_replica_owned_here_after_an_await() -> None:
    for entry in (_entry(3, b"S", 3), _entry(3, b"d", 5)):  # a marker; a delta after a gap
        follower, index, client = await _following()

        def agent_connects_here(f: Follower = follower, i: PrefixIndex = index) -> None:
            f.stop_following("r0")  # as the publisher's on_owned does on the agent's Hello
            i.store("r0", [999])  # the inventory server writes r0 from now on

        client.during = agent_connects_here
        client.hashes[follower.ctx.keys.snapshot("r0")] = _snap_hash(3, 3, [2])
        await follower._apply_entries(cast(Any, client), "r0", [entry])
        assert index.precise_keys("r0") == [999]


def test_the_others_queue_figures_add_up_and_the_oldest_wait_wins() -> None:
    rng, queues, want = random.Random(2), dict[str, list[float]](), [0.0, 0.0, 0.0]
    for _ in range(50):  # one instance's figures after another's
        pairs, shared, age = rng.randint(0, 99) / 2, rng.randint(0, 9) * 16, rng.randint(0, 5000)
        figures = decode_queue(b"%.1f,%d,%.1f" % (pairs, shared, age))
        _add_queue(queues, "r", figures)
        want = [want[0] + figures[0], want[1] + figures[1], max(want[2], figures[2])]
        assert queues["r"] == pytest.approx(want)
    with pytest.raises(codec.CodecError):  # an older instance counts a queue field as a decode error
        codec.decode_load(b"1.5,32,200.0")


def _hub(cfg: GatewayConfig) -> tuple[Hub, OwnerFleet, PrefixIndex]:
    index = PrefixIndex(cfg.index)
    fleet = OwnerFleet(cfg, index)
    hooks = HubHooks(lambda: None, lambda _n: None, lambda *_a: False, CollectorRegistry())
    return Hub(index, fleet, hooks), fleet, index


def test_the_owner_fleet_relays_each_input_after_applying_it() -> None:
    _, fleet, _ = _hub(_config(inventory={"allow_registration": True}, index={"max_replicas": 4}))

    def applied(data: bytes) -> None:  # the frame describes the fleet as it is now
        kind, payload = data[4:5], data[5:]
        rid, *rest = [codec.decode_hello(payload).replica_id] if kind == b"H" else decode_json(payload)
        rec = fleet.get(rid)
        assert rec is not None or kind != b"H"
        if rec is not None and kind == b"A":
            assert [rec.link.connected, rec.link.degraded] == rest
        elif rec is not None and kind in (b"N", b"E"):
            assert rest[0] == (rec.engine_load.running if kind == b"N" else rec.identity.hybrid)
        elif rec is not None and kind == b"C":
            assert (rec.health.ok_streak if rest[0] else rec.health.fail_streak) > 0

    fleet.relay, rng = applied, random.Random(1)
    inputs: list[Callable[[str], object]] = [
        lambda r: fleet.agent_state(r, connected=rng.random() < 0.5, degraded=rng.random() < 0.5),
        lambda r: fleet.agent_load(r, AgentLoad(rng.randrange(9), 0, 0.5, 0, 0)),
        lambda r: fleet.agent_engine(r, AgentEngine(rng.random() < 0.5, frozenset(), True)),
        lambda r: fleet.check_result(r, rng.random() < 0.5, "e"),
        lambda _r: fleet.forget_stale(1e12, 0.0),
    ]
    for step in range(600):
        rid = f"r{rng.randrange(8)}"
        if rng.random() < 0.2:
            fleet.agent_hello(_hello(rid))
            assert set(fleet.hellos) <= {r.id for r in fleet.records()}
        rng.choices(inputs, [2, 1, 1, 3, 0.2])[0](rid)
        assert len(fleet.hellos) <= 4, step


def test_every_frame_the_parent_relays_fits_frame_bound() -> None:
    """local_hub.py: a frame is at most ``frame_bound`` bytes, also the ops of an agent batch whose
    removals outnumber the replica's blocks (found false: every worker refused it, restarted)."""
    cfg = _config(index={"max_blocks_per_replica": 8, "approximate_blocks_per_replica": 0})
    hub, fleet, index = _hub(cfg)
    sent: list[bytes] = []
    hub._conns[1] = cast(Any, SimpleNamespace(send=sent.append))
    server = InventoryServer(index, fleet, token=None, registry=CollectorRegistry())
    server.observer, s = hub, StreamState(peer="p", task=None)
    server._handle(s, hello("r0").SerializeToString())
    server._handle(s, snap(2, [1, 2]).SerializeToString())
    singles, clears = [removed(k) for k in range(3000)], [pb.Event(cleared=pb.Cleared())] * 100
    # the most op bytes for the message's: empty removals (5 for 4), empty stores (9 for 4, last)
    empties = [[removed()] * 3000, [pb.Event(stored=pb.Stored())] * 3000]
    for i, batch in enumerate([[removed(*range(10**6, 1_140_000))], singles, clears, *empties]):
        before = len(sent)
        server._handle(s, raw := events(3 + i, *batch).SerializeToString())
        assert len(sent) == before + 1  # its ops frame: 9/4 of its message and the header at most
        assert len(sent[-1]) <= 2.25 * len(raw) + 64 <= inventory_ops.OPS_FRAME_EXPANSION * len(raw)
    assert len(sent[-1]) > 2.2 * len(raw) and max(map(len, sent)) <= frame_bound(index)  # worst last


_APPLIERS = {"inventory_server": "_handle", "local_hub": "_handle", "local_hub_client": "_apply"}


@pytest.mark.parametrize("module", ["fleet", "inventory_stream", "inventory_ops", *_APPLIERS])
def test_index_mutations_never_await(module: str) -> None:
    """Each module's "mutations never await": no coroutine in the module, or the function that
    applies what arrives is not one (a plain function cannot await, nor can what it calls)."""
    tree = ast.parse((Path(__file__).resolve().parents[2] / f"gateway/{module}.py").read_text())
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    coroutines = {k for k, n in defs.items() if isinstance(n, ast.AsyncFunctionDef)}
    only = _APPLIERS.get(module)
    assert (only in defs and only not in coroutines) if only else not coroutines, (module, coroutines)
