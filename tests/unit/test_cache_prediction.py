"""A prefix evicted while it waits (``evicted_before_prefill``): what the queue ahead on a
replica allocates beyond the room its flights' KV and the prefix leave comes out of the
prefix's tail, except the blocks flights there hold in use; the snapshot carries it per
replica, kv_aware and the cached-token prediction count only the blocks expected still cached."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from router_policies import placement
from router_policies.cache_prediction import evicted_before_prefill, predicted_cached_tokens
from router_policies.policies.kv_aware import KvAware
from router_policies.policies.kv_aware_params import KvAwareParams
from router_policies.policy import FleetSnapshot, ReplicaState, RequestFeatures
from router_policies.prefix_index import PrefixIndex
from router_policies.ttft.params import DEFAULT_PRIOR

B = 16


def test_what_the_queue_ahead_allocates_beyond_the_room_comes_out_of_the_prefix_tail() -> None:
    # (queued ahead, in use by the flights there, capacity); the prefix's unpinned part is free
    assert evicted_before_prefill(100, 0, (2000, 4800, 6400), B) == 0  # 4,800 + 1,600: fits
    assert evicted_before_prefill(100, 0, (2000, 4801, 6400), B) == 1  # one token over: one block
    assert evicted_before_prefill(100, 0, (2000, 6400, 6400), B) == 100  # 1,600 over: all 100
    assert evicted_before_prefill(168, 0, (5949, 5949, 6400), B) == 140  # the trace's first case
    assert evicted_before_prefill(100, 0, (160, 9000, 6400), B) == 10  # no more than it allocates
    assert evicted_before_prefill(100, 0, (0, 9000, 6400), B) == 0  # nothing allocates: none
    assert evicted_before_prefill(100, 0, (9000, 9000, 6400), B) == 100  # never more than matched
    assert evicted_before_prefill(100, 0, (9000, 9000, 0), B) == 0  # capacity unknown: none
    assert evicted_before_prefill(100, 60, (9000, 9000, 6400), B) == 40  # in use: never evicted
    assert evicted_before_prefill(100, 100, (9000, 9000, 6400), B) == 0
    assert evicted_before_prefill(0, 0, (9000, 9000, 6400), B) == 0


def _snapshot(pending: int, flights: tuple[Sequence[int], ...] = (), capacity: int = 6400) -> ReplicaState:
    """Replica "a" holding all of a 1,600-token prompt (keys 1-100), ``pending`` uncached tokens
    queued ahead, and ``flights``: the block keys of each request in flight there."""
    index = PrefixIndex()
    index.add_replica("a")
    keys = list(range(1, 101))
    index.store("a", keys)
    blocks = sum(len(f) for f in flights)
    load = placement.ReplicaLoad(len(flights), blocks * B, pending)
    repeated = blocks - len({k for f in flights for k in f})  # counted more than once
    cand = placement.Candidate(
        "a", True, load, in_flight_shared_tokens=repeated * B, flight_prompts=[list(f) for f in flights]
    )
    view = placement.IndexView({"a": 100}, {"a": 100.0}, index, keys, B)
    model = dataclasses.replace(DEFAULT_PRIOR, kv_capacity_tokens=capacity) if capacity else None
    (state,) = placement.snapshot([cand], view, ttft=lambda _: model).replicas
    return state


def _other(blocks: int, first: int = 1000) -> range:
    """Keys of a prompt sharing nothing with the request's."""
    return range(first, first + blocks)


def test_the_snapshot_carries_the_blocks_expected_evicted() -> None:
    assert _snapshot(pending=4800).evicted_blocks == 0  # 4,800 + 1,600 = the capacity
    s = _snapshot(pending=5600)
    assert (s.matched_blocks, s.evicted_blocks, s.expected_blocks) == (100, 50, 50)
    # a flight there leading with the prefix's first 70 blocks pins them (its 420 blocks: 6,720)
    assert _snapshot(pending=5600, flights=(_chain(70, 350),)).evicted_blocks == 30
    assert _snapshot(pending=5600, flights=(range(2, 71),)).evicted_blocks == 50  # not leading
    assert _snapshot(pending=50_000, capacity=0).evicted_blocks == 0  # no model: no capacity known


def _chain(shared: int, own: int) -> list[int]:
    """A prompt whose first ``shared`` blocks are the request's, then ``own`` of its own."""
    return [*range(1, shared + 1), *_other(own)]


def test_the_prompts_running_there_hold_their_kv_too() -> None:
    """Requests running on the replica hold their prompts' blocks until they end, so the queue
    ahead's allocations find less room: with 800 tokens queued and 5,600 in use, the 800 come
    out of the prefix (the queue alone, 800 + 1,600, fits the 6,400 easily)."""
    assert _snapshot(pending=800, flights=(_other(350),)).evicted_blocks == 50
    assert _snapshot(pending=800, flights=(_other(300),)).evicted_blocks == 0  # exactly full
    # nothing queued ahead: nothing allocates before the prefill (the engine waits for room)
    assert _snapshot(pending=0, flights=(_other(600),)).evicted_blocks == 0
    # two requests sharing 50 blocks: the engine holds those once (350 blocks, not 400)
    shared = (_other(200), [*_other(50), *_other(150, first=5000)])
    assert _snapshot(pending=1600, flights=shared).evicted_blocks == 50
    # no more than the queue ahead allocates
    assert _snapshot(pending=160, flights=(_other(600),)).evicted_blocks == 10
    # the queue ahead's uncached prefill is the least the flights hold (other routers' flights)
    assert _snapshot(pending=5600, flights=(_other(62),)).evicted_blocks == 50
    # a flight holding the prefix's first 70 blocks: pinned, the other 30 free
    assert _snapshot(pending=800, flights=(_chain(70, 350),)).evicted_blocks == 30
    assert _snapshot(pending=800, flights=(_chain(70, 250),)).evicted_blocks == 0
    # a flight ahead that will compute the whole prefix itself (a speculative match): kept
    assert _snapshot(pending=1600, flights=(_chain(100, 400),)).evicted_blocks == 0


def test_the_requests_own_prompt_does_not_evict_its_prefix() -> None:
    """An engine pins a request's cached prefix before it allocates the rest of its prompt
    (vLLM's ``allocate_slots`` touches the computed blocks first): a long prompt behind a
    short queue keeps its 10 matched blocks."""
    index = PrefixIndex()
    index.add_replica("a")
    keys = list(range(1, 376))  # a 6,000-token prompt, its first 10 blocks held
    index.store("a", keys[:10])
    load = placement.ReplicaLoad(1, 3000, 3000)
    cand = placement.Candidate("a", True, load, flight_prompts=[list(_other(187))])
    view = placement.IndexView({"a": 10}, {"a": 10.0}, index, keys, B)
    model = dataclasses.replace(DEFAULT_PRIOR, kv_capacity_tokens=6400)
    (state,) = placement.snapshot([cand], view, ttft=lambda _: model).replicas
    assert state.evicted_blocks == 0


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


def test_the_flights_blocks_are_counted_once() -> None:
    a, b = list(_other(300)), [*_other(100), *_other(50, first=5000)]
    assert placement._distinct_blocks([a, b]) == 350
    assert placement._distinct_blocks([a, tuple(b), a]) == 350
    assert placement._distinct_blocks([]) == 0
