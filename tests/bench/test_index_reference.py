"""The numba-table ``PrefixIndex`` against the pure-Python one it replaced (kept verbatim in
``bench/dict_prefix_index.py`` as the benchmark's baseline): the same random operation sequences
must give the same results, the same inventories and the same exact approximate-entry order.
Covers what the unit tests do not reach: more than 64 replicas (a second mask word), table
growth and rehashing, dead keys coming back, snapshots with mixed media."""

from __future__ import annotations

import random

import pytest

from bench.dict_prefix_index import PrefixIndex as RefIndex
from router_policies.prefix_index import IndexBoundError, IndexConfig, PrefixIndex


def _apply(ix: PrefixIndex | RefIndex, op: str, rep: str, keys: list[int], t: float) -> object:
    try:
        if op in ("store", "store_cpu", "touch", "replace"):
            # PrefixIndex tracks only replicas it is given (the gateway's Fleet adds them); the
            # reference added them on first use, which this reproduces
            ix.add_replica(rep)
        if op == "store":
            return ix.store(rep, keys)
        if op == "store_cpu":
            return ix.store(rep, keys, "CPU")
        if op == "remove":
            return ix.remove(rep, keys)
        if op == "touch":
            ix.touch_approximate(rep, keys, t)
            return None
        if op == "clear":
            return ix.clear_replica(rep)
        if op == "clear_approx":
            ix.clear_approximate(rep)
            return None
        if op == "drop":
            ix.remove_replica(rep)
            return None
        if op == "expire":
            return ix.expire(t)
        if op == "replace":
            ix.replace_replica(rep, {k: ("CPU" if k % 3 == 0 else "GPU") for k in keys})
            return None
        m = ix.match(keys)
        return dict(m.blocks), dict(m.scores)
    except IndexBoundError:
        return "bound"


def _same(a: PrefixIndex, b: RefIndex, names: list[str], key_space: int) -> None:
    assert a.entries == b.entries and len(a) == len(b)
    assert sorted(a.replicas) == sorted(b.replicas)
    for r in names:
        assert a.approximate_keys(r) == b.approximate_keys(r)
        assert sorted(a.precise_keys(r)) == sorted(b.precise_keys(r))
        assert a.precise_count(r) == b.precise_count(r)
    for k in range(0, key_space, max(1, key_space // 50)):
        assert a.holders_of(k) == b.holders_of(k)


OPS = ["store", "store_cpu", "remove", "touch", "clear", "clear_approx", "drop", "expire", "replace", "match"]


@pytest.mark.parametrize("seed", range(40))
def test_small_key_space_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    kw = {
        "max_blocks_per_replica": rng.choice([5, 8, 50]),
        "max_total_blocks": rng.choice([10, 20, 200]),
        "approximate_blocks_per_replica": rng.choice([0, 3, 5, 100]),
        "approximate_ttl_s": rng.choice([3, 5, 50]),
    }
    a, b = PrefixIndex(IndexConfig(**kw)), RefIndex(IndexConfig(**kw))
    names = ["a", "b", "c"]
    for t in range(120):
        op, rep = rng.choice(OPS), rng.choice(names)
        keys = [rng.randrange(15) for _ in range(rng.randrange(8))]
        if rng.random() < 0.5:
            keys = list(dict.fromkeys(keys))
        assert _apply(a, op, rep, keys, float(t)) == _apply(b, op, rep, keys, float(t)), (t, op, rep, keys)
        _same(a, b, names, 15)


@pytest.mark.parametrize("seed", range(4))
def test_many_replicas_and_growth_match_reference(seed: int) -> None:
    rng = random.Random(1000 + seed)
    kw = {"max_blocks_per_replica": 3000, "max_total_blocks": 60_000, "approximate_blocks_per_replica": 400}
    a, b = PrefixIndex(IndexConfig(**kw)), RefIndex(IndexConfig(**kw))
    names = [f"r{i}" for i in range(70)]  # slots beyond 63 need a second mask word
    heads = [[rng.getrandbits(64) for _ in range(40)] for _ in range(8)]
    for t in range(400):
        op, rep = rng.choice(OPS), rng.choice(names)
        head = rng.choice(heads)
        keys = head[: rng.randrange(1, 40)] + [rng.randrange(6000) for _ in range(rng.randrange(200))]
        assert _apply(a, op, rep, keys, float(t)) == _apply(b, op, rep, keys, float(t)), (t, op, rep)
        if t % 20 == 0:
            _same(a, b, names, 6000)
    _same(a, b, names, 6000)


def test_table_memory_per_key_stays_bounded_while_growing() -> None:
    """The key table (the bulk of the index) stays under 50 bytes per distinct key at up to 64
    replicas, at every size on the way up (load between MAX_LOAD / 2 and MAX_LOAD)."""
    rng = random.Random(7)
    ix = PrefixIndex(IndexConfig(max_blocks_per_replica=400_000, max_total_blocks=1_000_000))
    for r in range(64):
        ix.add_replica(f"r{r}")
    for step in range(300):
        keys = [rng.getrandbits(64) for _ in range(1000)]
        ix.store(f"r{step % 64}", keys)
        assert ix.table_bytes() / len(ix) <= 50.0, (step, ix.table_bytes(), len(ix))
