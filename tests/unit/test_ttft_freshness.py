"""Stale TTFT fits (router_policies.ttft.freshness): a replica with no first token for ``stale_s``
of the feed's time while its peers have theirs is priced as its fresh peers' typical fit until its
next first token, which its own (kept) fit learns from; kv_aware's time_r then stops starving it."""

from __future__ import annotations

import pytest

from router_policies.placement import Dispatch, FlightCounters, TtftFeed
from router_policies.policy import FleetSnapshot, ReplicaState, RequestFeatures
from router_policies.registry import build_policy
from router_policies.ttft.features import predict
from router_policies.ttft.freshness import MAX_REPLICAS, PROBATION, STALE_S, Freshness
from router_policies.ttft.params import DEFAULT_PRIOR


def _first_token(feed: TtftFeed, replica: str, at: float, slowness: float) -> None:
    """One flight on ``replica`` at ``at`` (a prompt of 500-4,000 tokens, by the time), first
    byte ``slowness`` x the prior's prediction later."""
    prompt = 500 + int(at * 700) % 3500
    f = feed.flight(FlightCounters(), Dispatch(ReplicaState(replica), prompt, 0, 16, 8), start=at)
    assert f.probe is not None
    f.first_byte(at + slowness * predict(DEFAULT_PRIOR, f.probe.inputs).total_ms / 1000)


def test_stale_only_while_peers_are_observed() -> None:
    f = Freshness(stale_s=10.0)
    f.observed("a", 0.0)
    f.observed("b", 5.0)
    assert not f.stale("a") and not f.stale("b") and not f.stale("never-seen")
    f.observed("b", 10.5)
    assert f.stale("a") and not f.stale("b")
    f.observed("a", 11.0)
    assert not f.stale("a")


def test_the_record_is_bounded_by_the_models_replicas() -> None:
    f = Freshness()
    for i in range(MAX_REPLICAS + 50):
        f.observed(f"r{i}", float(i))
    assert len(f.replicas()) == MAX_REPLICAS and "r0" not in f.replicas()


def _fitted_fleet() -> TtftFeed:
    """slow (3x the prior) and two fast replicas (the prior's speed) fitted for 20 s of feed time."""
    feed = TtftFeed()
    for i in range(40):
        for rid, k in (("slow", 3.0), ("fast1", 1.0), ("fast2", 1.0)):
            _first_token(feed, rid, i * 0.5, k)
    return feed


def _slow_goes_quiet(feed: TtftFeed) -> None:
    """Then first tokens of the fast replicas only, for 2 x STALE_S."""
    t = feed.freshness.latest
    while t < 20.0 + 2 * STALE_S:
        for rid in ("fast1", "fast2"):
            _first_token(feed, rid, t, 1.0)
        t += 0.5


def _fleet_where_slow_went_quiet() -> TtftFeed:
    feed = _fitted_fleet()
    _slow_goes_quiet(feed)
    return feed


def test_a_stale_fit_is_priced_as_its_fresh_peers_typical_one() -> None:
    feed = _fleet_where_slow_went_quiet()
    assert feed.freshness.stale("slow")
    assert feed.params("slow") in (feed.params("fast1"), feed.params("fast2"))
    assert feed.model.params("slow").observations > 0  # its own fit is kept until it comes back


def test_its_next_first_token_ends_the_spell_and_its_own_fit_learns_it() -> None:
    feed = _fleet_where_slow_went_quiet()
    own_before = feed.model.params("slow").observations
    _first_token(feed, "slow", feed.freshness.latest + 0.1, 3.0)
    assert not feed.freshness.stale("slow")
    assert feed.params("slow") is feed.model.params("slow")
    assert feed.params("slow").observations == own_before + 1


def test_time_r_stops_starving_a_replica_whose_fit_went_stale() -> None:
    """The fault table's case (docs/performance.md, "Speed in the token rule"): a replica fitted
    slow gets no new prompt while its fit is current, and is priced as its peers once stale."""
    feed = _fitted_fleet()
    policy = build_policy("kv_aware", {"speed_ratio": 2})
    req = RequestFeatures(model="m", block_keys=list(range(1, 65)), prompt_tokens=1024, block_size=16)

    def times() -> dict[str, float]:
        fleet = FleetSnapshot(tuple(ReplicaState(r, ttft=feed.params(r)) for r in ("slow", "fast1", "fast2")))
        return {r: terms["time"] for r, terms in policy.choose(req, fleet).terms.items()}

    assert times()["slow"] > 2 * times()["fast1"]
    _slow_goes_quiet(feed)
    assert times() == pytest.approx({"slow": 1.0, "fast1": 1.0, "fast2": 1.0})


def test_a_probe_its_peers_predicted_better_starts_a_probation_its_own_fit_catches_up_in() -> None:
    """The spell is over (first tokens at the prior's speed again): the probe is closer to the
    peers' fit than to its own, so the replica stays priced as its peers for PROBATION first
    tokens while its own fit learns; after them its own fit is of its peers' speed group."""
    feed = _fleet_where_slow_went_quiet()
    policy = build_policy("kv_aware", {"speed_ratio": 2})
    req = RequestFeatures(model="m", block_keys=list(range(1, 65)), prompt_tokens=1024, block_size=16)
    t = feed.freshness.latest + 0.1
    for k in range(PROBATION):
        _first_token(feed, "slow", t + 0.1 * k, 1.0)
        assert feed.freshness.as_peers("slow") and not feed.freshness.stale("slow"), k
        assert feed.params("slow") is not feed.model.params("slow")  # priced as a peer
    _first_token(feed, "slow", t + 0.1 * PROBATION, 1.0)
    assert not feed.freshness.as_peers("slow")
    assert feed.params("slow") is feed.model.params("slow")
    fleet = FleetSnapshot(tuple(ReplicaState(r, ttft=feed.params(r)) for r in ("slow", "fast1", "fast2")))
    times = {r: terms["time"] for r, terms in policy.choose(req, fleet).terms.items()}
    assert times == pytest.approx({"slow": 1.0, "fast1": 1.0, "fast2": 1.0})  # its own fit caught up


def test_probation_is_forgotten_with_the_replica() -> None:
    f = Freshness()
    f.observed("r0", 0.0, probation=True)
    assert f.as_peers("r0")
    for i in range(1, MAX_REPLICAS + 1):
        f.observed(f"r{i}", float(i))
    assert "r0" not in f.replicas() and f.unseen("r0")  # forgotten: as a new replica
    f.observed("r0", float(MAX_REPLICAS + 1))
    assert not f.as_peers("r0")  # its probation went with it


def test_unseen_only_while_peers_are_observed() -> None:
    f = Freshness()
    assert not f.unseen("a") and not f.as_peers("a")  # nobody answered yet: every prior stands
    f.observed("b", 0.0)
    assert f.unseen("a") and f.as_peers("a") and not f.unseen("b")


def _fast_pair() -> TtftFeed:
    """a and b fitted 2.5x faster than the prior (engines faster than the H100 default); c,
    started with them, has not answered yet."""
    feed = TtftFeed()
    for i in range(30):
        for rid in ("a", "b"):
            _first_token(feed, rid, i * 0.2, 0.4)
    return feed


def test_a_replica_that_has_not_answered_yet_is_priced_as_its_fitted_peers() -> None:
    """Priced by its prior instead, c looked 2.5x slower than a and b: time_r kept every prompt
    from it, so no first token could ever correct it. As its peers, it takes a prompt when a and
    b are busier."""
    feed = _fast_pair()
    assert feed.params("c") in (feed.params("a"), feed.params("b"))
    assert feed.params("c") is not feed.model.params("c")  # its own model is still the prior
    policy = build_policy("kv_aware", {"speed_ratio": 2})
    req = RequestFeatures(model="m", block_keys=list(range(1, 65)), prompt_tokens=1024, block_size=16)
    busy = {"a": 1000, "b": 1000, "c": 0}
    fleet = FleetSnapshot(
        tuple(ReplicaState(r, pending_prefill_tokens=busy[r], ttft=feed.params(r)) for r in busy)
    )
    assert policy.choose(req, fleet).replica == "c"
    prior_priced = FleetSnapshot(
        tuple(ReplicaState(r, pending_prefill_tokens=busy[r], ttft=feed.model.params(r)) for r in busy)
    )
    assert policy.choose(req, prior_priced).replica != "c"  # the starvation this prevents


@pytest.mark.parametrize(("slowness", "probation"), [(0.4, True), (1.0, False)])
def test_its_first_token_decides_between_its_peers_and_its_own_prior(
    slowness: float, probation: bool
) -> None:
    """As fast as its peers: its prior predicted it worse, so it stays priced as them on
    probation while its own fit learns; as slow as its prior said: its own fit at once."""
    feed = _fast_pair()
    _first_token(feed, "c", feed.freshness.latest + 0.1, slowness)
    assert not feed.freshness.unseen("c")
    assert feed.freshness.as_peers("c") is probation
    assert (feed.params("c") is feed.model.params("c")) is not probation
