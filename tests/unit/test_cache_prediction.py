"""A prefix evicted while it waits (``evicted_before_prefill``): the queue ahead on a replica
plus the request's own prompt beyond the replica's KV capacity come out of the prefix's tail,
except the blocks flights there hold in use; the snapshot carries it per replica, kv_aware and
the cached-token prediction count only the blocks expected still cached."""

from __future__ import annotations

import dataclasses

from router_policies import placement
from router_policies.cache_prediction import evicted_before_prefill, predicted_cached_tokens
from router_policies.policies.kv_aware import KvAware, KvAwareParams
from router_policies.policy import FleetSnapshot, ReplicaState, RequestFeatures
from router_policies.prefix_index import PrefixIndex
from router_policies.ttft.params import DEFAULT_PRIOR

B = 16


def test_what_goes_beyond_the_capacity_comes_out_of_the_prefix_tail() -> None:
    # (prompt, queued ahead, capacity)
    assert evicted_before_prefill(100, 0, (3000, 2000, 6400), B) == 0  # fits: nothing evicted
    assert evicted_before_prefill(100, 0, (3000, 3400, 6400), B) == 0  # exactly full
    assert evicted_before_prefill(100, 0, (3000, 3401, 6400), B) == 1  # one token over: one block
    assert evicted_before_prefill(100, 0, (3000, 5000, 6400), B) == 100  # 1,600 over: all 100
    assert evicted_before_prefill(168, 0, (2815, 5949, 6400), B) == 148  # the trace's first case
    assert evicted_before_prefill(100, 0, (3000, 9000, 6400), B) == 100  # never more than matched
    assert evicted_before_prefill(100, 0, (3000, 9000, 0), B) == 0  # capacity unknown: none
    assert evicted_before_prefill(100, 60, (3000, 9000, 6400), B) == 40  # in use: never evicted
    assert evicted_before_prefill(100, 100, (3000, 9000, 6400), B) == 0
    assert evicted_before_prefill(0, 0, (3000, 9000, 6400), B) == 0


def _snapshot(pending: int, held: frozenset[int] = frozenset(), capacity: int = 6400) -> ReplicaState:
    index = PrefixIndex()
    index.add_replica("a")
    keys = list(range(1, 101))  # a 1,600-token prompt, all held
    index.store("a", keys)
    load = placement.ReplicaLoad(1, 0, pending)
    cand = placement.Candidate("a", True, load, held_keys=held)
    view = placement.IndexView({"a": 100}, {"a": 100.0}, index, keys, 1600, B)
    model = dataclasses.replace(DEFAULT_PRIOR, kv_capacity_tokens=capacity) if capacity else None
    (state,) = placement.snapshot([cand], view, ttft=lambda _: model).replicas
    return state


def test_the_snapshot_carries_the_blocks_expected_evicted() -> None:
    assert _snapshot(pending=4800).evicted_blocks == 0  # 4,800 + 1,600 = the capacity
    s = _snapshot(pending=5600)
    assert (s.matched_blocks, s.evicted_blocks, s.expected_blocks) == (100, 50, 50)
    assert _snapshot(pending=5600, held=frozenset(range(1, 71))).evicted_blocks == 30  # 70 pinned
    assert _snapshot(pending=5600, held=frozenset(range(2, 71))).evicted_blocks == 50  # not leading
    assert _snapshot(pending=50_000, capacity=0).evicted_blocks == 0  # no model: no capacity known


def _replica(name: str, matched: int, evicted: int, pending: int) -> ReplicaState:
    return ReplicaState(name, matched_blocks=matched, evicted_blocks=evicted, pending_prefill_tokens=pending)


def test_kv_aware_leaves_a_holder_whose_queue_will_evict_the_prefix() -> None:
    """The holder's queue (5,949 tokens) pushes the prefix out before the request's prefill:
    it is no better a place than an idle replica, and it is busier."""
    policy = KvAware(KvAwareParams())
    req = RequestFeatures("m", tuple(range(176)), 2815, B)
    kept = FleetSnapshot((_replica("a", 168, 0, 5949), _replica("b", 0, 0, 0)))
    assert policy.choose(req, kept).replica == "a"  # as the index alone says: the prefix holds
    lost = FleetSnapshot((_replica("a", 168, 148, 5949), _replica("b", 0, 0, 0)))
    assert policy.choose(req, lost).replica == "b"
    assert predicted_cached_tokens(lost.replicas[0].expected_blocks, 2815, B) == 320
