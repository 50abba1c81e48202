"""Exact-outcome tests of the prefix index: match, idempotent mutations, bounds, and the
leaf-first LRU eviction order of approximate entries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router_policies.prefix_index import IndexBoundError, IndexConfig, PrefixIndex, UnknownReplicaError


def idx(replicas: tuple[str, ...] = ("a", "b", "c"), **kw: float) -> PrefixIndex:
    """An index tracking ``replicas`` (the gateway's Fleet adds them; the index never does)."""
    ix = PrefixIndex(IndexConfig(**kw))
    for r in replicas:
        ix.add_replica(r)
    return ix


def test_match_returns_each_replicas_leading_run() -> None:
    ix = idx()
    ix.store("a", [1, 2, 3, 4])
    ix.store("b", [1, 2])
    ix.store("c", [2, 3, 4])  # holds later blocks but not the first: no leading run
    m = ix.match([1, 2, 3, 9])
    assert dict(m.blocks) == {"a": 3, "b": 2}
    assert dict(m.scores) == {"a": 3.0, "b": 2.0}
    assert ix.match([]).blocks == {}
    assert ix.match([9]).blocks == {}


def test_match_weights_by_medium() -> None:
    ix = idx(medium_weights={"GPU": 1.0, "CPU": 0.5})  # type: ignore[arg-type]
    ix.store("a", [1, 2], medium="GPU")
    ix.store("a", [3], medium="CPU")
    m = ix.match([1, 2, 3])
    assert m.blocks["a"] == 3
    assert m.scores["a"] == pytest.approx(2.5)


def test_store_remove_clear_are_idempotent() -> None:
    ix = idx()
    assert ix.store("a", [1, 2, 3]) == 3
    assert ix.store("a", [1, 2, 3, 3]) == 0
    assert ix.entries == 3
    assert ix.remove("a", [2, 2, 99]) == 1
    assert ix.remove("a", [2]) == 0
    assert ix.remove("nobody", [1]) == 0
    assert dict(ix.match([1, 2, 3]).blocks) == {"a": 1}
    assert ix.clear_replica("a") == 2
    assert ix.clear_replica("a") == 0
    assert len(ix) == 0 and ix.entries == 0


def test_shared_keys_keep_other_holders() -> None:
    ix = idx()
    ix.store("a", [1, 2])
    ix.store("b", [1, 2])
    ix.remove("a", [1])
    assert ix.holders_of(1) == ["b"]
    assert ix.holders_of(2) == ["a", "b"]
    ix.remove_replica("b")
    assert ix.holders_of(1) == []
    assert ix.replicas == ["a", "c"]


def test_precise_bound_refuses_and_leaves_index_unchanged() -> None:
    ix = idx(max_blocks_per_replica=3)
    ix.store("a", [1, 2])
    with pytest.raises(IndexBoundError):
        ix.store("a", [3, 4])
    assert sorted(ix.precise_keys("a")) == [1, 2]
    ix.store("a", [2, 3])  # 2 already held: only one new entry
    assert ix.precise_count("a") == 3


def test_total_bound() -> None:
    ix = idx(max_total_blocks=4)
    ix.store("a", [1, 2, 3])
    with pytest.raises(IndexBoundError):
        ix.store("b", [1, 2])
    assert ix.precise_keys("b") == []
    ix.store("b", [1])
    assert ix.entries == 4


def test_replace_replica_is_atomic() -> None:
    ix = idx(max_blocks_per_replica=3)
    ix.store("a", [1, 2])
    ix.replace_replica("a", {2: "GPU", 3: "CPU", 4: "GPU"})
    assert sorted(ix.precise_keys("a")) == [2, 3, 4]
    with pytest.raises(IndexBoundError):
        ix.replace_replica("a", {5: "GPU", 6: "GPU", 7: "GPU", 8: "GPU"})
    assert sorted(ix.precise_keys("a")) == [2, 3, 4]
    ix.replace_replica("a", {})
    assert ix.precise_keys("a") == [] and ix.entries == 0


def test_approximate_entries_expire_after_ttl() -> None:
    ix = idx(approximate_ttl_s=10)
    ix.touch_approximate("a", [1, 2], now=0.0)
    ix.touch_approximate("a", [1, 3], now=5.0)
    assert dict(ix.match([1, 2]).blocks) == {"a": 2}
    assert ix.expire(now=12.0) == 1  # block 2, last touched at 0
    assert dict(ix.match([1, 2]).blocks) == {"a": 1}
    assert ix.expire(now=16.0) == 2
    assert ix.entries == 0 and len(ix) == 0


def test_eviction_is_leaf_first_lru_exact_order() -> None:
    ix = idx(approximate_blocks_per_replica=100)
    # tree:   1 - 2 - 3        (t=0)
    #          \- 4            (t=1)
    #   5 - 6                  (t=2)
    ix.touch_approximate("a", [1, 2, 3], now=0.0)
    ix.touch_approximate("a", [1, 4], now=1.0)
    ix.touch_approximate("a", [5, 6], now=2.0)
    # leaves first, oldest first; a parent only after its children
    assert ix.approximate_keys("a") == [3, 2, 4, 1, 6, 5]


def test_capacity_evicts_in_that_order() -> None:
    ix = idx(approximate_blocks_per_replica=4)
    ix.touch_approximate("a", [1, 2, 3], now=0.0)
    ix.touch_approximate("a", [1, 4], now=1.0)  # 4 entries: 1,2,3,4
    ix.touch_approximate("a", [5], now=2.0)  # evicts leaf 3 (oldest leaf)
    assert sorted(ix.approximate_keys("a")) == [1, 2, 4, 5]
    ix.touch_approximate("a", [6], now=3.0)  # evicts 2, now a leaf and the oldest
    assert sorted(ix.approximate_keys("a")) == [1, 4, 5, 6]
    ix.touch_approximate("a", [1, 4], now=4.0)  # refresh the 1-4 branch
    ix.touch_approximate("a", [7], now=5.0)  # evicts 5, the least recently used leaf
    assert sorted(ix.approximate_keys("a")) == [1, 4, 6, 7]
    assert ix.entries == 4


def test_shared_prefix_outlives_one_off_tails() -> None:
    ix = idx(approximate_blocks_per_replica=3)
    for t in range(10):
        ix.touch_approximate("a", [100, 1000 + t], now=float(t))
    # the shared head survives every eviction; only the newest tails remain
    assert sorted(ix.approximate_keys("a")) == [100, 1008, 1009]


def test_precise_supersedes_approximate() -> None:
    ix = idx()
    ix.touch_approximate("a", [1, 2], now=0.0)
    ix.store("a", [1])
    assert ix.approximate_keys("a") == [2]
    assert ix.entries == 2
    ix.touch_approximate("a", [1, 2], now=1.0)  # 1 is precise: not duplicated
    assert ix.approximate_keys("a") == [2]
    ix.clear_approximate("a")
    assert dict(ix.match([1, 2]).blocks) == {"a": 1}


def test_long_prompt_keeps_its_head_within_capacity() -> None:
    ix = idx(approximate_blocks_per_replica=3)
    ix.touch_approximate("a", list(range(10)), now=0.0)
    assert sorted(ix.approximate_keys("a")) == [0, 1, 2]


def test_zero_capacity_disables_approximate_entries() -> None:
    ix = idx(approximate_blocks_per_replica=0)
    ix.touch_approximate("a", [1, 2], now=0.0)
    assert ix.entries == 0


def test_max_replicas_bound_and_slot_reuse() -> None:
    ix = idx((), max_replicas=2)
    ix.add_replica("a")
    ix.add_replica("b")
    with pytest.raises(IndexBoundError):
        ix.add_replica("c")
    ix.remove_replica("a")
    ix.add_replica("c")
    ix.store("c", [1])
    assert ix.holders_of(1) == ["c"]


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "touch", "clear", "expire"]),
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(min_value=0, max_value=12), max_size=6),
    ),
    max_size=60,
)


@settings(max_examples=200)
@given(ops)
def test_bounds_hold_and_holders_agree_with_inventories(seq: list[tuple[str, str, list[int]]]) -> None:
    ix = idx(
        max_blocks_per_replica=8, max_total_blocks=20, approximate_blocks_per_replica=5, approximate_ttl_s=5
    )
    for t, (op, rep, keys) in enumerate(seq):
        try:
            if op == "store":
                ix.store(rep, keys)
            elif op == "remove":
                ix.remove(rep, keys)
            elif op == "touch":
                ix.touch_approximate(rep, keys, now=float(t))
            elif op == "clear":
                ix.clear_replica(rep)
            else:
                ix.expire(now=float(t))
        except IndexBoundError:
            pass
        total = 0
        expected: dict[int, set[str]] = {}
        for r in ix.replicas:
            precise, approx = ix.precise_keys(r), ix.approximate_keys(r)
            assert len(precise) <= 8 and len(approx) <= 5
            assert not set(precise) & set(approx)
            total += len(precise) + len(approx)
            for k in [*precise, *approx]:
                expected.setdefault(k, set()).add(r)
        assert total == ix.entries <= 20
        assert len(ix) == len(expected)
        for k, holders in expected.items():
            assert set(ix.holders_of(k)) == holders


def test_holds_since_sees_precise_entries_and_fresh_approximate_ones() -> None:
    idx = PrefixIndex(IndexConfig())
    idx.add_replica("a")
    idx.store("a", [1, 2])
    idx.touch_approximate("a", [1, 2, 3], now=10.0)
    assert idx.holds_since("a", 2, since=1e9)  # precise: always
    assert idx.holds_since("a", 3, since=10.0) and not idx.holds_since("a", 3, since=10.5)
    assert not idx.holds_since("a", 4, since=0.0) and not idx.holds_since("b", 1, since=0.0)


def test_unknown_replicas_are_refused_and_nothing_changes() -> None:
    ix = idx(("a",))
    ix.store("a", [1])
    for mutate in (
        lambda: ix.store("x", [1, 2]),
        lambda: ix.touch_approximate("x", [1, 2], now=0.0),
        lambda: ix.replace_replica("x", {1: "GPU"}),
    ):
        with pytest.raises(UnknownReplicaError):
            mutate()
        assert ix.replicas == ["a"] and ix.entries == 1 and ix.holders_of(1) == ["a"]
    assert ix.remove("x", [1]) == 0  # nothing to forget: not a refusal
    ix.add_replica("x")
    assert ix.store("x", [1, 2]) == 2


def test_a_shorter_lifetime_lowers_later_stamps_so_nothing_outlives_its_ttl() -> None:
    """The gateway back-dates the entries of a replica whose agent is connected (they live
    ``speculative_ttl_s``, not the TTL). When the agent connects to a replica that already has
    entries, the new back-dated stamps are older than those entries: unless the index keeps the
    stamps monotone, expiry stops at the front entry and the new ones live up to TTL - lifetime
    longer than they should (110 s with the defaults)."""
    ix = idx(approximate_ttl_s=120)
    ix.touch_approximate("a", [1, 2], now=100.0)  # no agent yet: lives until 220
    ix.touch_approximate("a", [3, 4], now=105.0 - 110.0)  # back-dated as before: lives until 15
    assert ix.expire(now=116.0) == 4  # every entry stamped at or before the newest one is gone
    assert ix.approximate_keys("a") == []
    # the same through ``lifetime_s``, which back-dates inside the index
    ix.touch_approximate("b", [1, 2], now=100.0)
    ix.touch_approximate("b", [3, 4], now=105.0, lifetime_s=10.0)
    assert [t for _, t in ix.approximate_expiry("b")] == [115.0] * 4
    assert ix.holds_since("b", 3, since=105.0, lifetime_s=10.0)
    assert not ix.holds_since("b", 3, since=105.5, lifetime_s=10.0)
    assert ix.expire(now=115.5) == 4


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(min_value=0, max_value=9), max_size=5),
            st.sampled_from([None, 1.0, 3.0, 50.0]),
            st.integers(min_value=0, max_value=3),
        ),
        max_size=40,
    )
)
def test_stamps_stay_monotone_and_nothing_outlives_its_lifetime(
    seq: list[tuple[list[int], float | None, int]],
) -> None:
    ix = idx(approximate_ttl_s=5, approximate_blocks_per_replica=6)
    now = 0.0
    deadline: dict[int, float] = {}  # latest lifetime end each key was given
    for keys, lifetime, step in seq:
        now += step
        ix.touch_approximate("a", keys, now=now, lifetime_s=lifetime)
        for k in keys[:6]:
            deadline[k] = now + min(lifetime or 5.0, 5.0)
        expiry = ix.approximate_expiry("a")
        assert [t for _, t in expiry] == sorted(t for _, t in expiry)
        for k, t in expiry:
            assert t <= deadline[k]  # never later than the lifetime its last touch gave it
        ix.expire(now)
        assert all(t >= now for _, t in ix.approximate_expiry("a"))


@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["touch", "touch", "store", "remove"]),
            st.lists(st.integers(min_value=0, max_value=11), max_size=8),
            st.sampled_from([0.0, 0.5, 2.0]),
        ),
        max_size=40,
    )
)
def test_touch_moves_and_stamps_as_the_per_key_walk(seq: list[tuple[str, list[int], float]]) -> None:
    """``approx_lru.touch``'s shortcuts (a refresh moved in one pass; no membership pass on a
    replica without precise entries) leave the LRU order, the stamps and the expiries exactly
    as the plain walk (leaf first: an approximate key moves to the end, restamped; a key not
    held becomes a new entry; a precise one is skipped), then the cap's and the TTL's pops."""
    ix = idx(("a",), approximate_blocks_per_replica=6, approximate_ttl_s=4)
    model: dict[int, float] = {}  # insertion order = LRU order
    precise: set[int] = set()
    now = 0.0
    for op, keys, step in seq:
        now += step
        if op == "store":
            ix.store("a", keys)
            precise |= set(keys)
            model = {k: t for k, t in model.items() if k not in precise}
        elif op == "remove":
            ix.remove("a", keys)
            precise -= {k for k in keys if k not in model}
        else:
            ix.touch_approximate("a", keys, now)
            model = {k: t for k, t in model.items() if t >= now - 4}
            model = {k: min(t, now) for k, t in model.items()}
            for k in reversed(keys[:6]):
                if k not in precise:
                    model.pop(k, None)
                    model[k] = now
            while len(model) > 6:
                del model[next(iter(model))]
        assert ix.approximate_expiry("a") == [(k, t + 4) for k, t in model.items()]
