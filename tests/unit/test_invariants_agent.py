"""The stated invariants of the replica agent's modules that no other test enforced (orphans.py,
recovery.py, inventory.py, kv_groups.py, outbox.py; the sim engine's block registry and event
publisher), each checked over seeded random operation sequences where it is about sequences. Each
test names the invariant it checks, in the words of the module that states it."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import zmq

from replica_agent.engine_events import AllBlocksCleared, BlockRemoved, BlockStored, EngineEvent, EngineHash
from replica_agent.inventory import AgentInventory
from replica_agent.kv_groups import GroupTracker
from replica_agent.orphans import Orphan, OrphanStores, map_key
from replica_agent.outbox import Outbox
from replica_agent.recovery import MAX_PENDING_HINTS
from replica_agent.sim_engine.block_registry import BlockRegistry
from replica_agent.sim_engine.engine_hashes import HashFormat
from replica_agent.sim_engine.kv_events import BlockStored as WireStored
from replica_agent.sim_engine.kv_events import EventEncoding, KvEventPublisher
from router_policies.block_keys import block_keys, root_key
from router_policies.sim import replica_model as rm
from tests.unit.test_agent_inventory import RecordingSink, grouped, stored

SEEDS = range(4)
B = 2
Prefix = tuple[int, ...]


class Engine:
    """Random engine-shaped events over a small token alphabet (shared prefixes, repeated stores,
    evictions in any order). The prefixes registered at construction were cached before the agent
    started: stores below them have a parent the agent never saw (orphans)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.hash = rng, dict[Prefix, int]()
        for _ in range(3):
            self.extend((), rng.randint(1, 3))
        self.old = list(self.hash)

    def recent(self) -> list[Prefix]:
        return [*self.old, *list(self.hash)[-16:]]

    def extend(self, prefix: Prefix, n: int) -> Prefix:
        for _ in range(n):
            prefix = prefix + tuple(self.rng.choices((1, 2, 3), k=B))
            self.hash.setdefault(prefix, len(self.hash) + 1)
        return prefix

    def range(self) -> tuple[Prefix, Prefix, list[EngineHash]]:
        """A stored range: its parent prefix, the full prefix and the new blocks' hashes."""
        parent = () if self.rng.random() < 0.3 else self.rng.choice(self.recent())
        full = self.extend(parent, self.rng.randint(1, 3))
        return parent, full, [self.hash[full[:i]] for i in range(len(parent) + B, len(full) + 1, B)]

    def plain(self) -> EngineEvent:
        r = self.rng.random()
        if r < 0.02:
            return AllBlocksCleared()
        medium = "CPU" if self.rng.random() < 0.15 else "GPU"
        if r < 0.35:
            return BlockRemoved([self.hash[p] for p in self.rng.sample(self.recent(), 2)], medium)
        parent, full, hashes = self.range()
        return BlockStored(hashes, self.hash.get(parent), list(full[len(parent) :]), B, medium, None, None)

    def hint(self, inv: AgentInventory) -> None:
        """The gateway's held-prefix hint for a random prefix and one of its child blocks."""
        q = self.rng.choice(self.recent())
        kids = [p[len(q) :] for p in self.hash if len(p) == len(q) + B and p[: len(q)] == q]
        inv.held_prefix(block_keys(list(q), B, "m"), list(self.rng.choice(kids or [(1, 1)])))


def check_inventory(inv: AgentInventory, sink: RecordingSink) -> None:
    assert len(inv._map) <= inv.max_blocks and len(inv._partial) <= inv.max_blocks
    mapped = Counter(inv._map.values())
    # _refs counts the mappings to a key, plus (recovery.py) one per anchor holding it hashless
    assert {k: mapped[k] + inv._hashless.get(k, 0) for k in inv._refs} == inv._refs
    assert all(r > 0 for r in inv._refs.values()) and set(mapped) | set(inv._hashless) <= set(inv._refs)
    assert set(inv._refs) == set(inv._medium)  # in the inventory exactly when _refs[k] > 0
    assert set(sink.view) == set(inv.snapshot())  # the sink's view is snapshot()


@pytest.mark.parametrize("key_block_size", [None, 2 * B])
@pytest.mark.parametrize("seed", SEEDS)
def test_inventory_map_bound_refcounts_and_sink_view(seed: int, key_block_size: int | None) -> None:
    """inventory.py: ``_map`` (and ``_partial``) never hold more than ``max_blocks``; ``k`` is in
    the inventory exactly when ``_refs[k] > 0``; the sink's view equals ``snapshot()``. recovery.py:
    hashless keys are referenced once per anchor; learnt mappings are ordinary mappings."""
    rng = random.Random(seed)
    eng, sink = Engine(rng), RecordingSink()
    inv = AgentInventory("m", B, max_blocks=12, sink=sink, key_block_size=key_block_size)
    for _ in range(400):
        if rng.random() < 0.25:
            eng.hint(inv)
        else:
            inv.apply([eng.plain()])
        check_inventory(inv, sink)
    assert inv.stats.overflow_evictions > 0
    assert key_block_size is not None or inv.stats.adopted_blocks > 0


def test_map_bound_holds_when_an_adopted_orphan_has_bad_tokens() -> None:
    """inventory.py: ``_map`` never holds more than ``max_blocks`` entries, also when recovery
    maps an orphan's parent and the adopted orphan's store returns early (a token id it cannot
    key): found false before ``_learn`` kept the bound itself."""
    inv = AgentInventory("m", B, max_blocks=1)
    inv.apply([stored([5], None, [50, 51]), stored([11, 12], 3, [7, 8, -1, 9])])
    inv.held_prefix(block_keys([1, 2, 3, 4, 5, 6], B, "m"), [7, 8])
    assert len(inv._map) <= inv.max_blocks


def test_hashless_ancestors_leave_with_their_last_anchor() -> None:
    """recovery.py: K[:n-1] are referenced once per anchor that confirmed them and released when
    their last anchor leaves the inventory."""
    sink = RecordingSink()
    inv = AgentInventory("m", B, max_blocks=100, sink=sink)
    system = [1, 2, 3, 4, 5, 6, 7, 8]  # cached before the agent: hashes 1-4, never seen
    keys = block_keys(system, B, "m")
    inv.apply([stored([11], 3, [9, 9]), stored([21], 4, [8, 8])])  # children of hashes 3 and 4
    inv.held_prefix(keys[:3], [9, 9])
    inv.held_prefix(keys[:4], [8, 8])
    assert inv._hashless == {keys[0]: 2, keys[1]: 2}  # keys[2] is hashed (hash 3) for anchor 4
    inv.apply([BlockRemoved([21, 4], "GPU")])  # leaf first: anchor keys[3] goes
    assert set(keys[:3]) <= set(inv.snapshot()) and inv._hashless == {keys[0]: 1, keys[1]: 1}
    inv.apply([BlockRemoved([11, 3], "GPU")])  # the last anchor goes: its ancestors with it
    assert inv.snapshot() == {} == sink.view and inv.hashless_keys == 0


def test_pending_hints_are_bounded_oldest_dropped() -> None:
    """recovery.py: a hint that matches no orphan yet waits, at most MAX_PENDING_HINTS, oldest dropped."""
    inv = AgentInventory("m", B, max_blocks=1000)
    n = MAX_PENDING_HINTS + 10
    for i in range(n):
        inv.held_prefix([1000 + i], [i, i])
        assert len(inv._pending) <= MAX_PENDING_HINTS
    inv.apply([stored([1], 77, [0, 0]), stored([2], 78, [n - 1, n - 1])])
    assert 1000 + n - 1 in inv.snapshot()  # the newest hint waited for its orphan
    assert 1000 not in inv.snapshot() and len(inv.orphans) == 1  # the oldest was dropped


def test_recovery_is_off_for_multi_block_keys_and_hybrid_engines() -> None:
    """recovery.py: recovery is off for engines tracked per KV-cache group and when keys span
    several engine blocks: their blocks stay skipped."""
    multi = AgentInventory("m", B, max_blocks=100, key_block_size=2 * B)
    multi.apply([stored([11, 12], 3, [7, 8, 9, 10])])
    hybrid = AgentInventory("m", B, max_blocks=100)
    hybrid.apply([grouped([1], None, [1, 2], group=0, window=4), grouped([11], 3, [7, 8], group=0, window=4)])
    for inv in (multi, hybrid):
        inv.held_prefix(block_keys([1, 2, 3, 4, 5, 6], B, "m"), [7, 8])
        assert inv.stats.skipped_blocks > 0 and len(inv.orphans) == 0 and not inv._pending
        assert inv.hashless_keys == 0 and inv.stats.adopted_blocks == 0


def check_orphans(orphans: OrphanStores, seen: dict[int, tuple[Orphan, int]]) -> None:
    by_parent: dict[Any, dict[int, Orphan]] = {}
    by_first: dict[Any, dict[int, Orphan]] = {}
    by_block: dict[Any, dict[int, Orphan]] = {}
    for oid, o in orphans._events.items():
        ev = o.event
        by_parent.setdefault(o.parent, {})[oid] = by_first.setdefault(orphans._first(o), {})[oid] = o
        for h in ev.block_hashes[: o.blocks]:
            by_block.setdefault(map_key(h, ev.medium, ev.medium == "GPU"), {})[oid] = o
        # only truncated at its end: what is held is a prefix of the event, never growing
        assert 0 < o.blocks <= seen.setdefault(oid, (o, o.blocks))[1]  # (o kept alive: ids unique)
        seen[oid], kept = (o, o.blocks), o.held()
        assert kept.block_hashes == ev.block_hashes[: o.blocks] and len(kept.token_ids) >= o.blocks * B
        assert kept.token_ids == ev.token_ids[: len(kept.token_ids)]
    assert (orphans._by_parent, orphans._by_first, orphans._by_block) == (by_parent, by_first, by_block)
    assert orphans.bytes == sum(o.size for o in orphans._events.values())


@pytest.mark.parametrize("seed", SEEDS)
def test_orphan_bytes_indexes_and_truncation(seed: int) -> None:
    """orphans.py: ``_bytes`` is the estimated size of the events held and never exceeds
    ``max_bytes`` after ``add``; every held block is in ``_by_block``, every held event in
    ``_by_parent`` and ``_by_first``, leaving all three at once; events only lose blocks from their end."""
    rng = random.Random(seed)
    orphans, seen = OrphanStores(max_bytes=3000), dict[int, tuple[Orphan, int]]()
    next_hash = 1
    for _ in range(500):
        r, parent = rng.random(), rng.randint(1000, 1005)
        if r < 0.45:
            n = rng.randint(1, 4)  # unique block hashes: each block is stored once
            hashes, next_hash = list(range(next_hash, next_hash + n)), next_hash + n
            medium = rng.choice(["GPU", "GPU", "CPU"])
            tokens = [rng.randint(1, 2) for _ in range(n * B + rng.randint(0, 1))]
            orphans.add(BlockStored([*hashes], parent, tokens, B, medium, None, None), parent)
            assert orphans.bytes <= orphans.max_bytes
        elif r < 0.9:
            h = rng.randint(max(1, next_hash - 30), next_hash)
            orphans.remove(map_key(h, "CPU", False) if rng.random() < 0.3 else h)
        elif r < 0.98:
            for ev in orphans.take_children(parent):
                assert ev.parent == parent and ev.block_hashes
        else:
            orphans.clear()
        check_orphans(orphans, seen)
    assert orphans.dropped > 0


def test_orphan_index_with_a_block_stored_twice() -> None:
    """orphans.py: a block stored twice (vLLM keeps duplicate copies) is held by both copies'
    events, and each removal takes it from one of them, oldest first (found false when the index
    kept only the newer event: after both removals the older one still held the block)."""
    orphans = OrphanStores(max_bytes=1 << 20)
    orphans.add(stored([11], 3, [7, 8]), 3)
    orphans.add(stored([11], 3, [7, 8]), 3)  # a second copy of the same block
    first, second = orphans._events.values()
    assert list(orphans._by_block[11].values()) == [first, second]
    assert orphans.remove(11) and list(orphans._by_block[11].values()) == [second] and len(orphans) == 1
    assert orphans.remove(11) and 11 not in orphans._by_block and len(orphans) == 0
    assert not orphans.remove(11)


def hybrid_step(eng: Engine, window: bool) -> list[EngineEvent]:
    """One engine step of a Gemma-3-shaped engine: group 0 full attention, group 1 (once
    ``window``) a sliding window of two blocks listing a subset of each range's blocks; some
    copies offloaded to CPU."""
    rng = eng.rng
    medium = "CPU" if rng.random() < 0.15 else "GPU"
    if rng.random() < 0.35:
        return [BlockRemoved([eng.hash[rng.choice(eng.recent())]], medium, rng.randint(0, window))]
    parent, full, hashes = eng.range()
    ph, tokens = eng.hash.get(parent), list(full[len(parent) :])
    listed = sorted(rng.sample(hashes, rng.randint(1, len(hashes))), key=hashes.index)
    stores: list[EngineEvent] = [BlockStored(hashes, ph, tokens, B, medium, None, None, 0, "full_attention")]
    if window:
        stores.insert(0, BlockStored(listed, ph, tokens, B, medium, None, None, 1, "sliding_window", 2 * B))
    return stores


@pytest.mark.parametrize("max_blocks", [8, 100_000])
@pytest.mark.parametrize("seed", SEEDS)
def test_group_tracker_residency_links_and_reported_set(seed: int, max_blocks: int) -> None:
    """kv_groups.py: ``_res`` holds at most ``max_blocks`` entries; ``_copies``' keys are a subset of
    ``_res``'s; ``_held[g][k]`` counts group g's entries mapping to k; at most ``2 * max_blocks``
    links; ``reported[k]`` exists exactly when ``_reusable(k)`` (checked while no link was dropped:
    see the xfail below), every change passed to the sink in order."""
    rng = random.Random(seed)
    eng, sink = Engine(rng), RecordingSink()
    inv, reported = AgentInventory("m", B, max_blocks=max_blocks, sink=sink), 0
    for step in range(300):
        inv.apply(hybrid_step(eng, window=step >= 40))  # plain tracking first, then per group
        if (g := inv._groups) is None:
            continue
        assert len(g._res) <= max_blocks and len(g._up) <= 2 * max_blocks
        assert set(g._copies) <= set(g._res) and all(n >= 2 for n in g._copies.values())
        for group, held in g._held.items():
            assert held == Counter(k for (gr, _), k in g._res.items() if gr == group)
        if max_blocks > 1000:
            candidates = {k for held in g._held.values() for k in held}
            assert set(g.reported) == {k for k in candidates if g._reusable(k)}
        assert sink.view.keys() == g.reported.keys()
        reported += len(g.reported)
    g = inv._groups
    assert reported and g is not None and (max_blocks > 1000 or g.overflow_evictions > 0)


def test_key_of_bound() -> None:
    """kv_groups.py: at most ``2 * max_blocks`` hashes in ``key_of``, counted after a store's own
    hashes are in (found false when ``link`` trimmed before ``hold`` added them)."""
    g, root = GroupTracker(1, 3, None), root_key("m")
    for i in range(10):
        g.store(BlockStored([100 + i], None, [i], 1, "GPU", None, None, 0, "full_attention"), root, 0)
        assert len(g.key_of) <= 2 * g.max_blocks


def test_reported_set_after_links_are_dropped() -> None:
    """kv_groups.py: ``reported[k]`` exists exactly when ``_reusable(k)``, also after the oldest
    links are dropped (found false: a sliding-window group links whole ranges but holds only their
    window, and once the window's first block was evicted its child, whose link was gone, stayed
    reported: a hit the engine cannot serve)."""
    inv = AgentInventory("m", B, max_blocks=3)  # links: at most 6
    k = block_keys([1, 2, 3, 4], B, "m")
    inv.apply([grouped([1, 2], None, [1, 2, 3, 4], group=0, window=2 * B)])
    inv.apply([grouped([19], None, list(range(100, 112)), group=0, window=2 * B)])  # six new links
    inv.apply([BlockRemoved([1], "GPU", 0)])  # k[1]'s window (k[0], k[1]) is no longer held
    g = inv._groups
    assert g is not None and {x for x in g.reported if not g._reusable(x)} == set()
    assert k[1] not in inv.snapshot()


@pytest.mark.parametrize("seed", SEEDS)
def test_outbox_snapshot_plus_deltas_is_the_inventory(seed: int) -> None:
    """outbox.py: a snapshot taken as the outbox reopens, plus the deltas queued after it, is exactly
    the inventory; at most ``max_events`` wait (past that: a snapshot is due); ``wake`` is set
    whenever there is something to send. (The stream's steps as gateway_client.py takes them.)"""
    rng = random.Random(seed)
    eng, box = Engine(rng), Outbox(max_events=6)
    inv = AgentInventory("m", B, max_blocks=12, sink=box)
    gateway: set[int] | None = None  # the gateway's view while a stream is open
    for _ in range(400):
        r = rng.random()
        if r < 0.8:
            inv.apply([eng.plain()])
        elif r < 0.83:
            box.close()
            gateway = None
        elif r < 0.85 and gateway is not None:
            box.need_snapshot = True  # the gateway asks for a resync
            box.wake.set()
        elif gateway is None or box.need_snapshot:
            gateway = set(inv.snapshot())
            box.reopen()
        else:
            box.wake.clear()
            for ev in box.take():
                kind = ev.WhichOneof("kind")
                if kind == "stored":
                    gateway |= set(ev.stored.keys)
                elif kind == "removed":
                    gateway -= set(ev.removed.keys)
                else:
                    gateway.clear()
            assert gateway == set(inv.snapshot())
        assert len(box.events) <= box.max_events and (gateway is not None or not box.events)
        assert box.wake.is_set() or not (box.events or box.need_snapshot)
    assert box.overflows > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_block_registry_entry_exists_iff_referenced_or_cached(seed: int) -> None:
    """block_registry.py: an entry exists iff it is referenced or cached."""
    rng = random.Random(seed)
    reg = BlockRegistry("m", B, HashFormat.INT)
    refs, cached, running = Counter[int](), set[int](), list[list[int]]()
    for _ in range(500):
        r = rng.random()
        if r < 0.3 or not running:
            blocks = reg.describe([rng.randint(1, 2) for _ in range(rng.randint(0, 5) * B + 1)])
            reg.acquire(blocks)
            refs.update(blocks.keys)
            running.append(blocks.keys)
        elif r < 0.5:
            keys = running.pop(rng.randrange(len(running)))
            reg.release(keys)
            refs.subtract(keys)
        elif r < 0.75 and (keys := rng.choice(running)):
            i, j = sorted(rng.sample(range(len(keys) + 1), 2))
            reg.translate([rm.BlockStored(tuple(keys[i:j]), keys[i - 1] if i else None)])
            cached.update(keys[i:j])
        elif r < 0.98 and cached:
            k = rng.choice(sorted(cached))
            reg.translate([rm.BlockRemoved((k,))])
            cached.discard(k)
        elif r >= 0.98:
            reg.translate([rm.AllBlocksCleared()])
            cached.clear()
        assert set(reg._blocks) == {k for k, n in refs.items() if n > 0} | cached
        assert all(e.refs == refs[k] and e.cached == (k in cached) for k, e in reg._blocks.items())


class StubPub:
    """The PUB socket's send: records the flags; at its high-water mark, raises zmq.Again."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.flags = rng, set[int]()

    def send_multipart(self, _frames: Any, flags: int = 0) -> None:
        self.flags.add(flags)
        if self.rng.random() < 0.1:
            raise zmq.Again()


@pytest.mark.parametrize("seed", SEEDS)
def test_publisher_replay_buffer_ordered_and_bounded(seed: int) -> None:
    """kv_events.py: seqs in the replay buffer are strictly increasing and its length never exceeds
    replay_buffer, whatever the fault switch does; ``publish`` never blocks (PUB drops at its HWM)."""
    rng = random.Random(seed)
    pub = KvEventPublisher("inproc://unused", None, "kv", 5, EventEncoding.MAP)
    pub._pub = stub = StubPub(rng)  # type: ignore[assignment]
    for i in range(300):
        if rng.random() < 0.2:
            pub.set_faults(rng.randint(0, 2), rng.random() < 0.5, rng.randint(0, 2), rng.randint(0, 2))
        assert pub.publish([WireStored([i], None, [i, i], B)]) == i
        seqs = [seq for seq, _ in pub._buffer]
        assert len(seqs) <= 5 and seqs == sorted(set(seqs))
    assert stub.flags == {zmq.NOBLOCK}
