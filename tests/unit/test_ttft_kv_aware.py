"""kv_aware on predicted milliseconds: faster replicas, decode load and KV tiers decide; choose is
pure and commit advances the tie-break; the explain terms add up."""

from __future__ import annotations

import pytest

from router_policies.policy import FleetSnapshot, ReplicaState, RequestFeatures
from router_policies.registry import build_policy
from router_policies.ttft.params import DEFAULT_PRIOR, NAMED_PRIORS, TtftParams

BS = 64


def req(blocks: int, prompt: int | None = None) -> RequestFeatures:
    keys = list(range(1, blocks + 1))
    return RequestFeatures(model="m", block_keys=keys, prompt_tokens=prompt or blocks * BS, block_size=BS)


def scaled(k: float) -> TtftParams:
    return DEFAULT_PRIOR.with_coefficients(tuple(k * v for v in DEFAULT_PRIOR.coefficients()), 100, 0.05)


def test_the_faster_replica_wins_when_nothing_else_differs() -> None:
    f = FleetSnapshot((ReplicaState("slow", ttft=scaled(3.0)), ReplicaState("fast", ttft=scaled(1.0))))
    d = build_policy("kv_aware").choose(req(32), f)
    assert d.replica == "fast"
    assert d.terms["slow"]["ttft_ms"] == pytest.approx(3 * d.terms["fast"]["ttft_ms"], rel=1e-3)


def test_a_faster_replica_can_beat_a_short_match_on_a_slow_one() -> None:
    f = FleetSnapshot(
        (ReplicaState("slow", ttft=scaled(4.0), matched_blocks=8), ReplicaState("fast", ttft=scaled(1.0)))
    )
    assert build_policy("kv_aware").choose(req(64), f).replica == "fast"
    # the token rule cannot see speed: the match decides
    assert build_policy("kv_aware", {"rule": "tokens"}).choose(req(64), f).replica == "slow"


def test_decode_load_counts() -> None:
    busy = ReplicaState("busy", engine_running=200, in_flight_requests=200, in_flight_tokens=380_000)
    light = ReplicaState("light", engine_running=20, in_flight_requests=20, in_flight_tokens=40_000)
    d = build_policy("kv_aware", {"balance_abs": 1000}).choose(req(64), FleetSnapshot((busy, light)))
    assert d.replica == "light"
    t = d.terms["busy"]
    # one step carrying 200 decodes reading 380k KV tokens: 8 + 8.1 + 21.2 ms, plus 4,096 prefill tokens
    assert t["prefill_ms"] > d.terms["light"]["prefill_ms"] + 20


def test_terms_add_up_and_scores_are_costs() -> None:
    a = ReplicaState("a", pending_prefill_tokens=20_000, in_flight_requests=3, matched_blocks=40)
    b = ReplicaState("b", matched_on_media=(("DISK", 30),), matched_blocks=30)
    d = build_policy("kv_aware").choose(req(64), FleetSnapshot((a, b)))
    share = {"a": (1 + 3) / (1 + 1.5), "b": (1 + 0) / (1 + 1.5)}  # (1 + load) / (1 + mean load)
    for rid, t in d.terms.items():
        assert t["ttft_ms"] == pytest.approx(
            t["wait_ms"] + t["prefill_ms"] + t["read_ms"] + t["fetch_ms"], abs=0.01
        )
        assert d.scores[rid] == pytest.approx(t["cost"], abs=0.001)
        # cost = ttft + (spread x (1 + (miss_weight - 1) x share) - 1) x added, spread 1 here
        assert t["cost"] == pytest.approx(t["ttft_ms"] + 3 * share[rid] * t["added_ms"], abs=0.01)
    assert d.terms["b"]["fetch_ms"] > 1.0 and d.terms["a"]["fetch_ms"] == 0.0
    assert d.terms["a"]["wait_ms"] > 0.0 and d.terms["b"]["wait_ms"] == 0.0


def test_kv_on_a_slow_medium_costs_its_fetch() -> None:
    gpu = ReplicaState("gpu", matched_blocks=60)
    disk = ReplicaState("disk", matched_blocks=60, matched_on_media=(("DISK", 60),))
    d = build_policy("kv_aware").choose(req(64), FleetSnapshot((disk, gpu)))
    assert d.replica == "gpu"
    assert d.terms["disk"]["fetch_ms"] == pytest.approx(1.0 + 60 * 64 * 131_072 / 5e6, abs=0.001)


def test_choose_is_pure_and_commit_rotates_ties() -> None:
    f = FleetSnapshot((ReplicaState("a"), ReplicaState("b"), ReplicaState("c")))
    p = build_policy("kv_aware")
    assert [p.choose(req(4), f).replica for _ in range(3)] == ["a", "a", "a"]
    out = []
    for _ in range(4):
        d = p.choose(req(4), f)
        p.commit(d)  # type: ignore[attr-defined]
        out.append(d.replica)
    assert out == ["a", "b", "c", "a"]


def test_cold_start_uses_the_configured_prior() -> None:
    r = ReplicaState("a", pending_prefill_tokens=1000)
    for prior, params in (({"prior": "small-cpu"}, NAMED_PRIORS["small-cpu"]), ({}, DEFAULT_PRIOR)):
        f = FleetSnapshot((r, ReplicaState("b", pending_prefill_tokens=1000, ttft=params)))
        d = build_policy("kv_aware", prior).choose(req(8), f)
        assert d.terms["a"] == d.terms["b"]  # no fit yet: the prior is that model


def test_new_content_goes_where_fewer_requests_will_queue_behind_it() -> None:
    """A new session on a fleet of a busy fast replica and an idle slow one: its prefill delays the
    requests behind it on the busy one, so by load share the idle one takes it; with the same
    weight everywhere (behind_by_load false) the fast one always does."""
    fast = ReplicaState("fast", in_flight_requests=12, engine_running=12, in_flight_tokens=120_000)
    slow = ReplicaState("slow", ttft=scaled(2.0))
    f = FleetSnapshot((fast, slow))
    assert build_policy("kv_aware").choose(req(64), f).replica == "slow"
    assert build_policy("kv_aware", {"behind_by_load": False}).choose(req(64), f).replica == "fast"
