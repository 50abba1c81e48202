"""``placement.replace_snapshot``: the precise entries a replica's snapshot drops stay as
approximate entries of the given lifetime (matched, not predicted, promoted by a later report,
expired together), within the approximate bounds; on a hybrid replica, or through
``replace_replica`` itself, they go. The fleet's keep is the lifetime of a routed request's
entries on a replica with an agent."""

from __future__ import annotations

import pytest

from gateway.config import GatewayConfig
from gateway.fleet import Fleet
from router_policies.placement import replace_snapshot
from router_policies.prefix_index import IndexBoundError, IndexConfig, PrefixIndex


def idx(**kw: float) -> PrefixIndex:
    ix = PrefixIndex(IndexConfig(**kw))
    for r in ("a", "b"):
        ix.add_replica(r)
    return ix


def test_dropped_entries_stay_as_approximate_ones_for_the_lifetime() -> None:
    ix = idx(approximate_ttl_s=120)
    ix.store("a", [1, 2, 3, 4])
    ix.store("a", [5], medium="CPU")
    ix.store("b", [1, 2])
    removed = ix.removed_count("a")
    replace_snapshot(ix, "a", {1: "GPU", 2: "GPU"}, (100.0, 10.0))
    assert sorted(ix.precise_keys("a")) == [1, 2]
    assert sorted(ix.approximate_keys("a")) == [3, 4, 5]
    assert ix.precise_run("a", [1, 2, 3, 4]) == 2  # what the audit predicts: reported entries only
    assert dict(ix.match([1, 2, 3, 4, 5]).blocks) == {"a": 5, "b": 2}  # routing still sees them
    assert ix.entries == 7 and ix.stats()["a"] == {"precise": 2, "approximate": 3}
    assert ix.removed_count("a") == removed + 3  # gone from the precise inventory
    assert ix.precise_entries("a") == {1: "GPU", 2: "GPU"}
    # expiring together, at now + lifetime
    assert {t for _, t in ix.approximate_expiry("a")} == {110.0}
    assert ix.expire(109.9) == 0
    assert ix.expire(110.1) == 3
    assert ix.approximate_keys("a") == [] and ix.entries == 4


def test_a_later_report_makes_a_kept_entry_precise_again() -> None:
    ix = idx()
    ix.store("a", [1, 2, 3])
    replace_snapshot(ix, "a", {}, (0.0, 10.0))
    assert ix.precise_keys("a") == [] and sorted(ix.approximate_keys("a")) == [1, 2, 3]
    assert ix.store("a", [1, 2]) == 2
    assert sorted(ix.precise_keys("a")) == [1, 2] and ix.approximate_keys("a") == [3]
    replace_snapshot(ix, "a", {1: "GPU", 2: "GPU", 3: "GPU"}, (1.0, 10.0))
    assert ix.approximate_keys("a") == [] and ix.entries == 3


def test_kept_entries_come_after_older_guesses_with_monotone_stamps() -> None:
    ix = idx(approximate_ttl_s=120)
    ix.touch_approximate("a", [7, 8], now=50.0, lifetime_s=10.0)
    ix.touch_approximate("a", [9], now=60.0)  # a 120 s lifetime: stamped later than the kept ones
    ix.store("a", [1, 2])
    replace_snapshot(ix, "a", {}, (55.0, 10.0))
    keys = ix.approximate_keys("a")
    assert keys[:3] == [8, 7, 9] and sorted(keys[3:]) == [1, 2]
    expiries = [t for _, t in ix.approximate_expiry("a")]
    assert expiries == sorted(expiries)  # the order TTL expiry pops in


def test_kept_entries_obey_the_approximate_bound() -> None:
    ix = idx(approximate_blocks_per_replica=3)
    ix.touch_approximate("a", [10], now=0.0)
    ix.store("a", [1, 2, 3, 4])
    replace_snapshot(ix, "a", {}, (1.0, 10.0))
    assert len(ix.approximate_keys("a")) == 3 and 10 not in ix.approximate_keys("a")  # oldest first
    assert ix.entries == 3 and len(ix) == 3


def test_kept_entries_give_way_to_the_index_bounds() -> None:
    """They are guesses: a snapshot is never refused for them, they are evicted to fit."""
    ix = idx(max_total_blocks=5, max_blocks_per_replica=3)
    ix.store("a", [1, 2, 3])
    replace_snapshot(ix, "a", {4: "GPU", 5: "GPU", 6: "GPU"}, (0.0, 10.0))
    assert sorted(ix.precise_keys("a")) == [4, 5, 6]
    assert len(ix.approximate_keys("a")) == 2 and ix.entries == 5
    with pytest.raises(IndexBoundError):  # the snapshot's own bound: nothing changes
        replace_snapshot(ix, "a", {7: "GPU", 8: "GPU", 9: "GPU", 10: "GPU"}, (1.0, 10.0))
    assert sorted(ix.precise_keys("a")) == [4, 5, 6] and ix.entries == 5


def test_without_keep_or_on_a_hybrid_replica_dropped_entries_go() -> None:
    ix = idx()
    ix.store("a", [1, 2])
    ix.replace_replica("a", {})
    assert ix.approximate_keys("a") == [] and ix.entries == 0
    ix.set_hybrid("b", True)
    ix.store("b", [1, 2])
    replace_snapshot(ix, "b", {}, (0.0, 10.0))  # a hybrid engine's reusable keys depend on windows
    assert ix.approximate_keys("b") == [] and ix.entries == 0
    none = PrefixIndex(IndexConfig(approximate_blocks_per_replica=0))
    none.add_replica("a")
    none.store("a", [1])
    replace_snapshot(none, "a", {}, (0.0, 10.0))
    assert none.entries == 0


def test_the_fleet_keeps_them_as_long_as_a_routed_requests_entries() -> None:
    now = [1000.0]
    config = GatewayConfig.model_validate({"proxy": {"speculative_ttl_s": 7}})
    fleet = Fleet(config, PrefixIndex(), clock=lambda: now[0])
    assert fleet.snapshot_keep() == (1000.0, 7.0)
    short = Fleet(config, PrefixIndex(IndexConfig(approximate_ttl_s=3)), clock=lambda: now[0])
    assert short.snapshot_keep() == (1000.0, 3.0)  # never beyond the index's TTL
