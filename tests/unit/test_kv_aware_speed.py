"""kv_aware's token rule in each replica's time (time_r, ``speed_ratio``, 2 by default):
replicas of one speed group are priced exactly as by the plain token rule; a slower group's queue and own prefill cost
more; the requests behind stay in fleet tokens; groups are cut where speeds differ by more than
the ratio."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from router_policies.policies.kv_aware import REFS_PER_REPLICA, KvAware
from router_policies.policies.kv_aware_params import KvAwareParams
from router_policies.policies.kv_speed import speed_groups, speed_size
from router_policies.policy import FleetSnapshot, ReplicaState, RequestFeatures
from router_policies.registry import build_policy
from router_policies.ttft.params import DEFAULT_PRIOR, TtftParams

BS = 16
TIMED: dict[str, object] = {"speed_ratio": 2.0}  # the default, named: the tests read as the rule


def req(blocks: int) -> RequestFeatures:
    return RequestFeatures(
        model="m", block_keys=list(range(1, blocks + 1)), prompt_tokens=blocks * BS, block_size=BS
    )


def scaled(k: float) -> TtftParams:
    return DEFAULT_PRIOR.with_coefficients(tuple(k * v for v in DEFAULT_PRIOR.coefficients()), 100, 0.05)


def test_groups_are_cut_where_speeds_differ_by_more_than_the_ratio() -> None:
    assert speed_groups([1.0, 3.0, 1.2, 3.3], 2.0) == [1.2, 3.3, 1.2, 3.3]
    # no chain: 3.6 is within 2x of 1.9 but not of its group's fastest, 1.0
    assert speed_groups([1.0, 1.9, 3.6], 2.0) == [1.9, 1.9, 3.6]
    assert speed_groups([5.0], 2.0) == [5.0]
    assert speed_groups([1.0, 2.0, 4.01], 2.0) == [2.0, 2.0, 4.01]


def test_speed_is_read_at_the_prompt_size_rounded_up_to_a_power_of_two_within_bounds() -> None:
    assert [speed_size(n) for n in (0, 1, 256, 257, 512, 3000)] == [256, 256, 256, 512, 512, 4096]
    assert speed_size(10**6) == 32768


def test_speed_ratio_is_off_or_above_one() -> None:
    for bad in (0.5, 1.0, -1.0):
        with pytest.raises(ValidationError):
            KvAwareParams(speed_ratio=bad)
    assert KvAwareParams(speed_ratio=0).speed_ratio == 0
    assert KvAwareParams().speed_ratio == 2.0  # on: a fleet of one speed is priced as before


def _random_fleet(rng: random.Random, speeds: list[float]) -> FleetSnapshot:
    return FleetSnapshot(
        tuple(
            ReplicaState(
                f"r{i}",
                ttft=scaled(k),
                matched_blocks=rng.choice((0, 0, 4, 20, 64)),
                pending_prefill_tokens=rng.choice((0, 0, 512, 4096)),
                in_flight_requests=rng.randrange(4),
                held_blocks=rng.randrange(1000),
            )
            for i, k in enumerate(speeds)
        )
    )


def test_one_speed_group_is_the_plain_token_rule_to_the_float() -> None:
    """Fits of identical replicas differ (here by up to 1.8x): within the ratio, every decision and
    every score is the plain token rule's, over a seeded sequence of fleets and requests."""
    rng = random.Random(7)
    timed = build_policy("kv_aware", TIMED)
    plain = build_policy("kv_aware", {"speed_ratio": 0})
    for _ in range(300):
        f = _random_fleet(rng, [rng.uniform(1.0, 1.8) for _ in range(4)])
        r = req(rng.choice((8, 64, 200)))
        a, b = timed.choose(r, f), plain.choose(r, f)
        assert (a.replica, a.scores) == (b.replica, b.scores)
        timed.commit(a)
        plain.commit(b)


def test_a_new_prompt_goes_to_the_faster_group_the_plain_rule_rotates() -> None:
    """Nothing held anywhere, nothing queued: the plain rule ties and rotates onto slow replicas
    (the first prompts of new tenants on bench/live.py's hetero fleet); time_r sends each to a
    fast one while its queue is not three times as long."""
    fleet = FleetSnapshot(tuple(ReplicaState(f"r{i}", ttft=scaled((1.0, 3.0)[i % 2])) for i in range(4)))
    timed = build_policy("kv_aware", TIMED)
    plain = build_policy("kv_aware", {"speed_ratio": 0})
    seen_timed, seen_plain = set(), set()
    for _ in range(4):
        a, b = timed.choose(req(100), fleet), plain.choose(req(100), fleet)
        seen_timed.add(a.replica)
        seen_plain.add(b.replica)
        timed.commit(a)
        plain.commit(b)
    assert seen_timed == {"r0", "r2"}
    assert seen_plain == {"r0", "r1", "r2", "r3"}


def test_own_part_in_the_replicas_time_behind_in_fleet_tokens() -> None:
    """cost_r = time_r x (pending + request_cost_tokens x load + uncached) + (miss_weight - 1) x
    uncached: the figures of the docstring's formula, to the token."""
    slow = ReplicaState(
        "slow", ttft=scaled(3.0), pending_prefill_tokens=1000, in_flight_requests=2, matched_blocks=50
    )
    fast = ReplicaState("fast", ttft=scaled(1.0))
    d = build_policy("kv_aware", {**TIMED, "fill_weight": 0}).choose(req(100), FleetSnapshot((slow, fast)))
    # refs 3:1, mean 2: time 1.5 and 0.5; uncached 800 and 1,600 tokens
    assert d.scores["slow"] == pytest.approx(1.5 * (1000 + 64 * 2 + 800) + 3 * 800)
    assert d.scores["fast"] == pytest.approx(0.5 * 1600 + 3 * 1600)
    assert d.replica == "slow"  # the match outweighs the speed here: the behind part is not scaled
    assert (d.terms["slow"]["time"], d.terms["fast"]["time"]) == pytest.approx((1.5, 0.5))


def test_the_speed_comes_from_each_replicas_fit_or_the_prior() -> None:
    """A replica the model owner has not fitted (a) is priced with the prior, so in the group of
    a replica fitted to the prior (b); one fitted 2.5x slower (c) is a group of its own."""
    f = FleetSnapshot(
        (ReplicaState("a"), ReplicaState("b", ttft=DEFAULT_PRIOR), ReplicaState("c", ttft=scaled(2.5)))
    )
    t = {r: terms["time"] for r, terms in build_policy("kv_aware", TIMED).choose(req(10), f).terms.items()}
    # refs 1 : 1 : 2.5, mean 1.5
    assert t == pytest.approx({"a": 1 / 1.5, "b": 1 / 1.5, "c": 2.5 / 1.5}, rel=1e-3)


def test_speed_is_read_at_the_requests_size_where_the_fits_were_fitted() -> None:
    """Two fits that agree on short prompts (all the traffic they saw) but extrapolate apart (one
    with 20x the attention cost: 3x slower on a lone 8,192-token prompt) are one speed group for a
    256-token request and two for an 8,192-token one."""
    coeffs = list(DEFAULT_PRIOR.coefficients())
    coeffs[2] *= 20  # attention_ms_per_mpair
    steep = DEFAULT_PRIOR.with_coefficients(tuple(coeffs), 100, 0.05)
    f = FleetSnapshot((ReplicaState("a", ttft=DEFAULT_PRIOR), ReplicaState("b", ttft=steep)))
    policy = build_policy("kv_aware", TIMED)
    short = {r: t["time"] for r, t in policy.choose(req(16), f).terms.items()}
    long = {r: t["time"] for r, t in policy.choose(req(512), f).terms.items()}
    assert short == {"a": 1.0, "b": 1.0}
    assert long["b"] > 2 * long["a"]


def test_the_reference_memory_stays_within_a_few_params_per_replica() -> None:
    """Each fit exports new params at every first token: the policy's memory of their reference
    TTFTs is cleared beyond REFS_PER_REPLICA per healthy replica, whatever the number of fits."""
    policy = build_policy("kv_aware", TIMED)
    assert isinstance(policy, KvAware)
    rng = random.Random(3)
    for _ in range(2000):
        policy.choose(req(8), _random_fleet(rng, [rng.uniform(1.0, 5.0) for _ in range(3)]))
        assert len(policy._refs) <= REFS_PER_REPLICA * 3 + 3
