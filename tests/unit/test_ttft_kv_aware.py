"""kv_aware on predicted milliseconds: faster replicas, decode load and KV tiers decide; choose is
pure and commit advances the tie-break; the explain terms add up."""

from __future__ import annotations

import pytest

from router_policies.policy import FleetSnapshot, ReplicaState, RequestFeatures
from router_policies.registry import build_policy
from router_policies.ttft.params import DEFAULT_PRIOR, NAMED_PRIORS, TtftParams

BS = 64
MS: dict[str, object] = {"rule": "ms"}  # the ms rule (opt-in; named so the tests say so)


def req(blocks: int, prompt: int | None = None) -> RequestFeatures:
    keys = list(range(1, blocks + 1))
    return RequestFeatures(model="m", block_keys=keys, prompt_tokens=prompt or blocks * BS, block_size=BS)


def scaled(k: float) -> TtftParams:
    return DEFAULT_PRIOR.with_coefficients(tuple(k * v for v in DEFAULT_PRIOR.coefficients()), 100, 0.05)


def test_the_faster_replica_wins_when_nothing_else_differs() -> None:
    f = FleetSnapshot((ReplicaState("slow", ttft=scaled(3.0)), ReplicaState("fast", ttft=scaled(1.0))))
    d = build_policy("kv_aware", MS).choose(req(32), f)
    assert d.replica == "fast"
    assert d.terms["slow"]["ttft_ms"] == pytest.approx(3 * d.terms["fast"]["ttft_ms"], rel=1e-3)


def test_a_faster_replica_can_beat_a_short_match_on_a_slow_one() -> None:
    f = FleetSnapshot(
        (ReplicaState("slow", ttft=scaled(4.0), matched_blocks=8), ReplicaState("fast", ttft=scaled(1.0)))
    )
    assert build_policy("kv_aware", MS).choose(req(64), f).replica == "fast"
    # the token rule sees speed through time_r (on by default; tests/unit/test_kv_aware_speed.py);
    # without it the match decides
    assert build_policy("kv_aware", {"rule": "tokens"}).choose(req(64), f).replica == "fast"
    assert build_policy("kv_aware", {"rule": "tokens", "speed_ratio": 0}).choose(req(64), f).replica == "slow"


def test_decode_load_counts() -> None:
    busy = ReplicaState("busy", engine_running=200, in_flight_requests=200, in_flight_tokens=380_000)
    light = ReplicaState("light", engine_running=20, in_flight_requests=20, in_flight_tokens=40_000)
    d = build_policy("kv_aware", {**MS, "balance_abs": 1000}).choose(req(64), FleetSnapshot((busy, light)))
    assert d.replica == "light"
    t = d.terms["busy"]
    # one step carrying 200 decodes reading 380k KV tokens: 8 + 8.1 + 21.2 ms, plus 4,096 prefill tokens
    assert t["prefill_ms"] > d.terms["light"]["prefill_ms"] + 20


def test_terms_add_up_and_scores_are_costs() -> None:
    a = ReplicaState("a", pending_prefill_tokens=20_000, in_flight_requests=3, matched_blocks=40)
    b = ReplicaState("b", matched_on_media=(("DISK", 30),), matched_blocks=30)
    d = build_policy("kv_aware", MS).choose(req(64), FleetSnapshot((a, b)))
    for rid, t in d.terms.items():
        assert t["ttft_ms"] == pytest.approx(
            t["wait_ms"] + t["prefill_ms"] + t["read_ms"] + t["fetch_ms"], abs=0.01
        )
        assert d.scores[rid] == pytest.approx(t["cost"], abs=0.001)
        # cost = ttft + (spread x (1 + (miss_weight - 1) x share) - 1) x added; spread 1 here,
        # share 1 (both replicas run the same model, so neither is faster than the fleet mean) and
        # miss_weight 7, the ms rule's default
        assert t["cost"] == pytest.approx(t["ttft_ms"] + 6 * t["added_ms"], abs=0.01)
    assert d.terms["b"]["fetch_ms"] > 1.0 and d.terms["a"]["fetch_ms"] == 0.0
    assert d.terms["a"]["wait_ms"] > 0.0 and d.terms["b"]["wait_ms"] == 0.0


def test_kv_on_a_slow_medium_costs_its_fetch() -> None:
    gpu = ReplicaState("gpu", matched_blocks=60)
    disk = ReplicaState("disk", matched_blocks=60, matched_on_media=(("DISK", 60),))
    d = build_policy("kv_aware", MS).choose(req(64), FleetSnapshot((disk, gpu)))
    assert d.replica == "gpu"
    assert d.terms["disk"]["fetch_ms"] == pytest.approx(1.0 + 60 * 64 * 131_072 / 5e6, abs=0.001)


def test_choose_is_pure_and_commit_rotates_ties() -> None:
    f = FleetSnapshot((ReplicaState("a"), ReplicaState("b"), ReplicaState("c")))
    p = build_policy("kv_aware", MS)
    assert [p.choose(req(4), f).replica for _ in range(3)] == ["a", "a", "a"]
    out = []
    for _ in range(4):
        d = p.choose(req(4), f)
        p.commit(d)
        out.append(d.replica)
    assert out == ["a", "b", "c", "a"]


def test_cold_start_uses_the_configured_prior() -> None:
    r = ReplicaState("a", pending_prefill_tokens=1000)
    for prior, params in (({"prior": "small-cpu"}, NAMED_PRIORS["small-cpu"]), ({}, DEFAULT_PRIOR)):
        f = FleetSnapshot((r, ReplicaState("b", pending_prefill_tokens=1000, ttft=params)))
        d = build_policy("kv_aware", {**MS, **prior}).choose(req(8), f)
        assert d.terms["a"] == d.terms["b"]  # no fit yet: the prior is that model


def test_the_delay_added_behind_is_weighed_at_fleet_speed() -> None:
    """A new 4,096-token prompt; a fast replica with a queue, an idle one twice as slow. Its own
    TTFT is shorter on the fast one until the queue is long, but the requests that will queue
    behind it on the fast one are more (a fast replica draws more traffic): behind "fleet" scales
    the added delay by each replica's speed relative to the fleet mean (1.5 and 0.75 here), so the
    slow one takes the prompt from a shorter queue on; "local" keeps it on the fast one longer."""
    slow = ReplicaState("slow", ttft=scaled(2.0))
    ms4 = {**MS, "miss_weight": 4.0}  # (miss_weight - 1) = 3 requests behind at fleet speed

    def choice(queue: int, behind: str) -> str:
        f = FleetSnapshot((ReplicaState("fast", pending_prefill_tokens=queue), slow))
        return build_policy("kv_aware", {**ms4, "behind": behind}).choose(req(64), f).replica

    assert [choice(q, "fleet") for q in (0, 4000, 8000)] == ["fast", "fast", "slow"]
    assert [choice(q, "local") for q in (0, 4000, 8000)] == ["fast", "fast", "fast"]
    f = FleetSnapshot((ReplicaState("fast"), slow))
    d = build_policy("kv_aware", ms4).choose(req(64), f)
    for rid, share in (("fast", 1.5), ("slow", 0.75)):
        t = d.terms[rid]
        assert t["cost"] == pytest.approx(t["ttft_ms"] + 3 * share * t["added_ms"], rel=1e-3)


def test_replicas_of_about_the_same_speed_are_priced_with_one_model() -> None:
    """Fits of identical replicas differ (a per-token cost traded for a per-step one, a little
    noise): within ``same_speed`` of the fleet median, every replica is priced with the median
    replica's model, so a new prompt goes by queue and cache, not by fit noise; a replica
    outside it (other hardware) keeps its own model."""
    near = [ReplicaState(f"r{i}", ttft=scaled(k)) for i, k in enumerate((0.9, 1.0, 1.2))]
    far = ReplicaState("a100", ttft=scaled(3.0))
    f = FleetSnapshot((*near, far))
    d = build_policy("kv_aware", MS).choose(req(256), f)
    assert d.terms["r0"] == d.terms["r1"] == d.terms["r2"]  # the median's model (scaled 1.2)
    assert d.terms["a100"]["ttft_ms"] > 2 * d.terms["r0"]["ttft_ms"]
    own = build_policy("kv_aware", {**MS, "same_speed": 0.0}).choose(req(256), f)
    assert own.terms["r0"]["ttft_ms"] < own.terms["r1"]["ttft_ms"] < own.terms["r2"]["ttft_ms"]
    # rule ms comes with miss_weight 7; the default rule is tokens (its terms: the cost and time_r)
    assert build_policy("kv_aware", {"rule": "ms", "miss_weight": 7}).choose(req(256), f).terms == d.terms
    assert set(build_policy("kv_aware", {}).choose(req(256), f).terms["r0"]) == {"cost", "time"}
