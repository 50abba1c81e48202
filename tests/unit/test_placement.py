"""The placement glue the gateway and the simulator share: predicted cached tokens, flight
accounting, snapshots, the speculative touch rule and the expiry sweep."""

from __future__ import annotations

import dataclasses

import pytest

from router_policies import placement
from router_policies.placement import predicted_cached_tokens, uncached_prompt_tokens
from router_policies.policy import ReplicaState
from router_policies.prefix_index import IndexConfig, PrefixIndex
from router_policies.ttft.params import TtftParams


def _index(**kw: float) -> PrefixIndex:
    ix = PrefixIndex(IndexConfig(**kw))
    for r in ("a", "b"):
        ix.add_replica(r)
    return ix


@pytest.mark.parametrize(
    ("matched", "prompt", "want_cached", "want_prefill"),
    [(0, 100, 0, 100), (3, 100, 48, 52), (4, 64, 48, 16), (4, 65, 64, 1), (1, 0, 0, 0)],
)
def test_pending_prefill_follows_the_engines_cached_tokens(
    matched: int, prompt: int, want_cached: int, want_prefill: int
) -> None:
    # a fully cached prompt that is a whole number of blocks still computes its last block
    cached = predicted_cached_tokens(matched, prompt, 16)
    assert (cached, uncached_prompt_tokens(prompt, cached)) == (want_cached, want_prefill)


def test_flights_release_exactly_what_they_added() -> None:
    c = placement.FlightCounters()
    f1, f2 = placement.Flight(c, 150, 100), placement.Flight(c, 20, 10)
    assert (c.requests, c.tokens, c.pending_prefill_tokens, c.started) == (2, 170, 110, 2)
    f1.first_byte()
    f1.first_byte()
    assert (c.requests, c.pending_prefill_tokens) == (2, 10)
    f1.end()
    f1.end()
    f2.end()  # ends without a first byte (a failed attempt): releases its prefill too
    assert (c.requests, c.tokens, c.pending_prefill_tokens, c.started) == (0, 0, 0, 2)


def test_snapshot_carries_load_match_fullness_and_exclusions() -> None:
    ix = _index()
    ix.store("a", [1, 2, 3])
    load = placement.ReplicaLoad(1, 2, 3, 4, 5, 0.5)
    snap = placement.snapshot(
        [placement.Candidate("a", True, load), placement.Candidate("b", True, placement.ReplicaLoad())],
        placement.IndexView({"a": 2}, {"a": 1.5}, ix),
        exclude=frozenset({"b"}),
    )
    a, b = snap.replicas
    assert (a.in_flight_requests, a.in_flight_tokens, a.pending_prefill_tokens) == (1, 2, 3)
    assert (a.engine_running, a.engine_waiting, a.kv_usage) == (4, 5, 0.5)
    assert (a.matched_blocks, a.match_score, a.held_blocks, a.healthy) == (2, 1.5, 3, True)
    assert (b.matched_blocks, b.held_blocks, b.healthy) == (0, 0, False)


def test_snapshot_states_equal_the_constructors_and_stay_frozen() -> None:
    """Every field of a snapshot's state, as the candidate and the index view give it (negative
    queue figures clamped to 0), and immutable."""
    ix = _index()
    ix.store("a", [1, 2])
    params = TtftParams(step_ms=20.0, prefill_ms_per_token=0.05)
    cand = placement.Candidate("a", True, placement.ReplicaLoad(1, 2, 3, 4, 5, 0.5), -1.0, -2, 7.5)
    (a,) = placement.snapshot(
        [cand], placement.IndexView({"a": 2}, {"a": 1.5}, ix), ttft=lambda _: params
    ).replicas
    expected = ReplicaState(
        "a",
        True,
        1,
        2,
        3,
        4,
        5,
        0.5,
        matched_blocks=2,
        match_score=1.5,
        held_blocks=2,
        pending_age_ms=7.5,
        ttft=params,
    )
    assert a == expected  # every field: ReplicaState compares them all
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.healthy = False  # type: ignore[misc]


def test_lifetime_is_short_with_an_agent_and_the_ttl_without() -> None:
    ix = _index(approximate_ttl_s=100)
    rule = placement.TouchRule(speculative_ttl_s=5.0)
    assert rule.lifetime_s(ix, has_agent=True) == 5.0
    assert rule.lifetime_s(ix, has_agent=False) == 100.0
    assert placement.TouchRule(speculative_ttl_s=500.0).lifetime_s(ix, has_agent=True) == 100.0
    placement.speculative_touch(ix, "a", [1, 2], now=50.0, lifetime_s=5.0)
    assert ix.approximate_expiry("a") == [(2, 55.0), (1, 55.0)]


def test_a_chain_is_refreshed_at_most_once_a_second_and_never_over_precise_entries() -> None:
    ix = _index()
    assert placement.speculative_touch(ix, "a", [11, 12, 13], now=10.0, lifetime_s=10.0)
    assert placement.speculative_touch(ix, "a", [11, 14], now=10.0, lifetime_s=10.0)  # a new leaf
    assert ix.approximate_keys("a") == [13, 12, 14, 11]
    assert not placement.speculative_touch(ix, "a", [11, 12, 13], now=10.5, lifetime_s=10.0)
    assert ix.approximate_keys("a") == [13, 12, 14, 11]
    assert not placement.speculative_touch(
        ix, "a", [11, 12, 13], now=11.0, lifetime_s=10.0
    )  # touched 1 s ago
    assert placement.speculative_touch(ix, "a", [11, 12, 13], now=11.25, lifetime_s=10.0)
    assert ix.approximate_keys("a") == [14, 13, 12, 11]
    ix.store("a", [21, 22])
    assert not placement.speculative_touch(ix, "a", [21, 22], now=20.0, lifetime_s=10.0)
    assert not placement.speculative_touch(ix, "a", [], now=20.0, lifetime_s=10.0)


def test_the_sweep_runs_the_latest_due_tick_as_every_tick_would() -> None:
    ix = _index(approximate_ttl_s=10)
    sweep = placement.ExpirySweep(ix, interval_s=1.0)
    sweep.advance(0.5)  # starts the tick grid: 1.5, 2.5, ...
    ix.touch_approximate("a", [1], now=0.5)
    ix.touch_approximate("a", [2], now=3.2)
    sweep.advance(10.9)  # the tick at 10.5 is 10 s after the first touch: nothing expires yet
    assert ix.approximate_keys("a") == [1, 2]
    sweep.advance(11.2)  # no tick due since 10.5
    assert ix.approximate_keys("a") == [1, 2]
    sweep.advance(13.4)  # ticks 11.5, 12.5 (skipped) and 13.5 (not yet): the one at 12.5 drops 1
    assert ix.approximate_keys("a") == [2]
    sweep.advance(40.0)
    assert ix.approximate_keys("a") == []
