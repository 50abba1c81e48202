"""The invariants stated in router_policies' index modules (replica_slots, block_table and its
kernels, prefix_index, approx_lru), each checked by a property over seeded random operation
sequences (the house rule: an invariant a comment states holds because a test or an assert says
so). Each test names the docstring it enforces; tests/unit/test_invariants_placement.py does the
same for the placement glue."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from router_policies import placement
from router_policies.block_table import MAX_LOAD, BlockTable, as_keys
from router_policies.index_types import IndexBoundError
from router_policies.prefix_index import IndexConfig, PrefixIndex
from router_policies.replica_slots import ReplicaSlots

REPO = Path(__file__).resolve().parents[2]
GOLD = 0x9E3779B97F4A7C15  # block_kernels._GOLD
MASK64 = (1 << 64) - 1
BS = 16


# ---------------------------------------------------------------------- helpers
class ChainTree:
    """Chained block keys: node ``i``'s key names its whole path from a root, as a prompt's keys
    do; a prompt is the path to a node (root first)."""

    def __init__(self, rng: random.Random, nodes: int, base: int = 1000) -> None:
        self.parent: dict[int, int | None] = {}
        keys: list[int] = []
        for i in range(nodes):
            key = base + i
            self.parent[key] = rng.choice(keys) if keys and rng.random() < 0.85 else None
            keys.append(key)
        self.keys = keys

    def path(self, key: int) -> list[int]:
        out = [key]
        while (p := self.parent[out[-1]]) is not None:
            out.append(p)
        return out[::-1]


def index_of(replicas: Sequence[str], **kw: float) -> PrefixIndex:
    ix = PrefixIndex(IndexConfig(**kw))
    for r in replicas:
        ix.add_replica(r)
    return ix


# ---------------------------------------------------------------------- replica_slots.py
@dataclass
class _Rec:
    slot: int


def test_replica_slots_are_inverse_maps_bounded_and_reuse_the_last_freed_slot_first() -> None:
    """replica_slots.py, "Invariants": ``records`` and ``by_slot`` are inverse maps, a slot is
    in use by at most one replica, at most ``limit`` slots are numbered; a freed slot is reused
    before a new one is numbered, last freed first; ``add`` of a tracked replica and a refused
    ``add`` change nothing."""
    for seed in range(30):
        rng = random.Random(seed)
        limit = rng.randint(1, 6)
        slots: ReplicaSlots[_Rec] = ReplicaSlots(limit)
        free: list[int] = []  # the model: freed slots, last freed at the end
        numbered = 0
        names = [f"r{i}" for i in range(limit + 3)]
        for _ in range(120):
            name = rng.choice(names)
            before = (dict(slots.records), dict(slots.by_slot))
            if rng.random() < 0.6:
                if name in slots.records:
                    slots.add(name, _Rec)
                    assert (slots.records, slots.by_slot) == before  # nothing if tracked already
                elif not free and numbered == limit:
                    with pytest.raises(IndexBoundError):
                        slots.add(name, _Rec)
                    assert (slots.records, slots.by_slot) == before  # refused: nothing changed
                else:
                    slots.add(name, _Rec)
                    want = free.pop() if free else numbered
                    numbered += want == numbered
                    assert slots.records[name].slot == want
            elif name in slots.records:
                free.append(slots.release(name).slot)
            assert {rec.slot: r for r, rec in slots.records.items()} == slots.by_slot
            assert len(slots.by_slot) == len(slots.records)
            assert all(0 <= s < limit for s in slots.by_slot)
            assert set(slots.by_slot) | set(free) == set(range(numbered))  # dense


# ---------------------------------------------------------------------- block_table.py / block_kernels.py
def _check_table(t: BlockTable, model: dict[int, int]) -> None:
    cap = t.capacity
    used = t.state != 0
    # ``used`` counts used slots; ``live`` those whose mask is non-zero
    assert t.used == int(used.sum())
    assert t.live == int((used & (t.masks != 0).any(axis=0)).sum())
    # the caller guarantees room (``reserve``): an empty slot always ends a probe
    assert t.used <= MAX_LOAD * cap
    # a key occupies at most one used slot ...
    held = t.keys[used]
    assert len(np.unique(held)) == len(held)
    # ... found by probing from hash(key) up to the first empty slot: no empty slot between
    empties = np.concatenate([[0], np.cumsum(np.concatenate([~used, ~used]))])
    for i in np.flatnonzero(used).tolist():
        h = ((int(t.keys[i]) * GOLD) & MASK64) >> (64 - t.bits)
        d = (i - h) & (cap - 1)
        assert empties[h + d + 1] - empties[h] == 0, (i, h)
    # the masks are the model's (64-bit keys round-trip: no float arithmetic in the kernels)
    for k, m in model.items():
        assert t.mask_of(k) == m, k


def test_block_table_keeps_its_probe_chains_counters_and_load_bound() -> None:
    """block_table.py, "Invariants": a key occupies at most one used slot, reached from its
    hash without crossing an empty slot; no kernel empties a used slot (only a rebuild drops dead
    keys); ``live`` and ``used`` count what they say; ``reserve`` keeps room for every probe.
    Checked after every ``set``/``unset``/``unset_slots`` of random batches, on keys across the
    whole uint64 range, for replica slots over three mask words, from a 16-slot table."""
    for seed in range(6):
        rng = random.Random(seed)
        t = BlockTable(bits=4)
        domain = [*range(1, 60), *(MASK64 - i for i in range(12)), *(rng.getrandbits(64) for _ in range(30))]
        model: dict[int, int] = {}
        for _ in range(150):
            slot = rng.choice([0, 1, 5, 63, 64, 70, 130])
            batch = [rng.choice(domain) for _ in range(rng.randrange(0, 25))]
            arrays, state, keys = t.keys, t.state.copy(), t.keys.copy()
            op = rng.random()
            if op < 0.55:
                newly = t.set(as_keys(batch), slot)
                want = {k for k in batch if not model.get(k, 0) >> slot & 1}
                assert len(newly) == len(want)
                if rng.random() < 0.3:  # a refused store: the undo of that set
                    t.unset_slots(newly, slot)
                else:
                    for k in want:
                        model[k] = model.get(k, 0) | 1 << slot
            else:
                cleared = t.unset(as_keys(batch), slot)
                gone = {k for k in batch if model.get(k, 0) >> slot & 1}
                assert cleared == len(gone)
                for k in gone:
                    model[k] &= ~(1 << slot)
            if t.keys is arrays:  # not rebuilt: every used slot stays used, with its key
                assert (t.state[state != 0] != 0).all()
                assert (t.keys[state != 0] == keys[state != 0]).all()
            _check_table(t, model)
            for s in (slot, 0, 130):
                assert sorted(t.keys_of(s).tolist()) == sorted(k for k, m in model.items() if m >> s & 1)


def test_as_keys_gives_the_layout_the_kernels_are_compiled_for() -> None:
    """block_table.as_keys: a uint64 array, C-contiguous and writable (the kernels are compiled
    for that layout), exact over [0, 2**64)."""
    strided = np.arange(20, dtype=np.uint64)[::2]
    frozen = np.arange(5, dtype=np.uint64)
    frozen.flags.writeable = False
    for keys in (strided, frozen, [0, 1, MASK64, MASK64 - 1], np.arange(3, dtype=np.uint64)):
        out = as_keys(keys)
        assert out.dtype == np.uint64 and out.flags.c_contiguous and out.flags.writeable
        assert out.tolist() == [int(k) for k in keys]


def test_keys_another_replica_holds_take_no_slot_and_growth_keeps_the_load_bound() -> None:
    """block_table.py, module docstring and ``reserve``: keys a batch brings that the table
    already holds take no slot and do not make it grow (found false before ``k_absent``: a second
    replica storing the 700 keys the first holds took the table from 1,024 to 4,096 slots, 99.5
    bytes a key); right after any growth the load is above 1/4 and at most 1/2 (a live key under
    4 slots' bytes, 68 at one word); grown by batches small beside it, above MAX_LOAD / 2 (under
    49 bytes a key)."""
    slot_bytes = 9 + 8 * 1
    rng = random.Random(0)
    shared = [rng.getrandbits(64) for _ in range(700)]
    ix = index_of(("a", "b"))
    ix.store("a", shared)
    before = ix.table_bytes()
    ix.store("b", shared)
    assert ix.table_bytes() == before and len(ix) == 700
    for small in (False, True):
        ix = index_of(("a",))
        grown = 0
        for _ in range(200):
            size = rng.randint(1, 40) if small else rng.choice((1, 10, 600, 2500))
            before = ix.table_bytes()
            ix.store("a", [rng.getrandbits(64) for _ in range(size)])
            if ix.table_bytes() > before:
                grown += 1
                load = len(ix) / (ix.table_bytes() / slot_bytes)
                assert 0.25 < load <= 0.5, (size, load)
                assert ix.table_bytes() / len(ix) < 4 * slot_bytes
                if small:
                    assert ix.table_bytes() / len(ix) < slot_bytes / (MAX_LOAD / 2), (size, load)
        assert grown >= 2


# ---------------------------------------------------------------------- prefix_index.py
def _index_state(ix: PrefixIndex, domain: Sequence[int]) -> object:
    return (
        ix.replicas,
        {
            r: (
                sorted(ix.precise_entries(r).items()),
                ix.approximate_expiry(r),
                ix.precise_count(r),
                ix.removed_count(r),
                ix.is_hybrid(r),
            )
            for r in ix.replicas
        },
        ix.entries,
        len(ix),
        [tuple(ix.holders_of(k)) for k in domain],
    )


def test_index_bits_counts_and_refusals_hold_over_random_mutations() -> None:
    """prefix_index.py, "Invariants": a replica's bit is set on a key iff it holds the key
    precisely or approximately, the two disjoint; ``precise_count`` = set bits - ``len(approx)``;
    a mutation that raises (a bound, an unknown replica) changes nothing; ``removed_count`` is
    monotone while the replica is in the index. The precise inventory is modelled independently
    (what the agent reported), over every mutation, hybrid replicas and snapshots included."""
    names = ["a", "b", "c", "d"]
    domain = list(range(16))
    for seed in range(25):
        rng = random.Random(seed)
        ix = PrefixIndex(
            IndexConfig(
                max_blocks_per_replica=6,
                max_total_blocks=14,
                approximate_blocks_per_replica=4,
                approximate_ttl_s=5,
                max_replicas=3,
            )
        )
        precise: dict[str, set[int]] = {}
        removed: dict[str, int] = {}
        now = 0.0
        for _ in range(120):
            now += rng.choice([0.0, 0.5, 1.0, 3.0])
            r = rng.choice(names)
            keys = [rng.choice(domain) for _ in range(rng.randrange(0, 7))]
            op = rng.choice(
                [
                    *("add", "drop", "hybrid", "store", "store", "remove", "clear", "clear_approx"),
                    *("touch", "touch", "forget", "expire", "replace", "snapshot"),
                ]
            )
            before = _index_state(ix, domain)
            try:
                if op == "add":
                    ix.add_replica(r)
                    precise.setdefault(r, set())
                elif op == "drop":
                    ix.remove_replica(r)
                    precise.pop(r, None)
                    removed.pop(r, None)
                elif op == "hybrid":
                    ix.set_hybrid(r, rng.random() < 0.5)
                elif op == "store":
                    ix.store(r, keys, rng.choice(["GPU", "CPU"]))
                    precise[r] |= set(keys)
                elif op == "remove":
                    ix.remove(r, keys)
                    if r in precise:
                        precise[r] -= set(keys)
                elif op == "clear":
                    ix.clear_replica(r)
                    if r in precise:
                        precise[r] = set()
                elif op == "clear_approx":
                    ix.clear_approximate(r)
                elif op == "touch":
                    ix.touch_approximate(r, keys, now, rng.choice([None, 2.0]))
                elif op == "forget":
                    ix.forget_approximate(r, keys)
                elif op == "expire":
                    ix.expire(now, rng.choice([None, r]) if r in precise else None)
                else:
                    entries = {k: rng.choice(["GPU", "CPU"]) for k in keys}
                    if op == "replace":
                        ix.replace_replica(r, entries)
                    else:
                        placement.replace_snapshot(ix, r, entries, (now, 3.0))
                    precise[r] = set(entries)
            except IndexBoundError:
                assert _index_state(ix, domain) == before, (seed, op, r, keys)  # nothing changed
            assert sorted(ix.replicas) == sorted(precise)
            total = 0
            for name in ix.replicas:
                approx = ix.approximate_keys(name)
                assert set(ix.precise_keys(name)) == precise[name]
                assert not precise[name] & set(approx)  # disjoint
                assert ix.precise_count(name) == len(precise[name])  # = set bits - len(approx)
                assert ix.removed_count(name) >= removed.get(name, 0)  # monotone
                removed[name] = ix.removed_count(name)
                total += len(precise[name]) + len(approx)
            for k in domain:  # the bit is set iff held precisely or approximately
                want = {n for n in ix.replicas if k in precise[n] or k in ix.approximate_keys(n)}
                assert set(ix.holders_of(k)) == want, (seed, op, k)
            assert ix.entries == total


def test_every_approximate_block_stands_before_its_parent() -> None:
    """prefix_index.py, "Invariants" (and approx_lru.py's): in each replica's approximate order
    every block stands before its parent (so the front entry, the one evicted and expired first,
    is always a leaf). Prompts are chained paths of a key tree; touches (with and without a
    lifetime, the speculative rule's too), the approximate cap, precise stores and removals,
    forgets and expiry interleave. (``replace_snapshot``'s kept entries are the stated
    exception and are left out.)"""
    for seed in range(25):
        rng = random.Random(seed)
        tree = ChainTree(rng, 40)
        ix = index_of(("a", "b"), approximate_blocks_per_replica=rng.choice([3, 6, 50]), approximate_ttl_s=6)
        now = 0.0
        for _ in range(150):
            now += rng.choice([0.0, 0.25, 1.0, 2.0])
            r = rng.choice(["a", "b"])
            path = tree.path(rng.choice(tree.keys))
            op = rng.random()
            if op < 0.45:
                ix.touch_approximate(r, path, now, rng.choice([None, 3.0]))
            elif op < 0.6:
                placement.speculative_touch(ix, r, path, now, 3.0)
            elif op < 0.7:
                ix.store(r, rng.sample(path, rng.randint(1, len(path))))
            elif op < 0.8:
                ix.remove(r, rng.sample(path, rng.randint(1, len(path))))
            elif op < 0.88:
                ix.forget_approximate(r, rng.sample(path, rng.randint(1, len(path))))
            else:
                ix.expire(now)
            for name in ("a", "b"):
                order = {k: i for i, k in enumerate(ix.approximate_keys(name))}
                for k, i in order.items():
                    p = tree.parent[k]
                    assert p is None or p not in order or i < order[p], (seed, name, k, p)


def test_a_fresh_leaf_means_its_whole_chain_is_fresh() -> None:
    """placement.speculative_touch: "a leaf stamped less than TOUCH_REFRESH_S ago means the whole
    chain was" (so skipping the re-touch loses nothing): whenever it declines with the leaf held
    approximately, every key of the (capped) chain is held precisely or stamped within
    TOUCH_REFRESH_S. Over speculative touches, precise stores, the cap and expiry (a forget, the
    undo of another request's touch, is documented to cut chains: gateway/routing.py's undo)."""
    for seed in range(25):
        rng = random.Random(seed)
        tree = ChainTree(rng, 30)
        cap = rng.choice([2, 4, 40])
        ix = index_of(("a",), approximate_blocks_per_replica=cap, approximate_ttl_s=20)
        lifetime = rng.choice([3.0, 20.0])
        now = 0.0
        declined = 0
        for _ in range(150):
            now += rng.choice([0.0, 0.25, 0.5, 1.0, 4.0])
            path = tree.path(rng.choice(tree.keys))
            op = rng.random()
            if op < 0.8:
                leaf = path[min(len(path), cap) - 1]
                leaf_precise = leaf in ix.precise_keys("a")
                if not placement.speculative_touch(ix, "a", path, now, lifetime) and not leaf_precise:
                    declined += 1
                    since = now - placement.TOUCH_REFRESH_S
                    assert all(ix.holds_since("a", k, since, lifetime) for k in path[:cap]), (seed, path)
            elif op < 0.9:
                ix.store("a", rng.sample(path, rng.randint(1, len(path))))
            else:
                ix.expire(now)
        assert declined > 0
