"""kv_aware's stall relief (router_policies/policies/kv_stall.py): a request whose cheapest
replica has a queue that does not move goes to the cheapest replica where nothing waits; a queue
its prefill explains, a young one, or a fleet with no quiet replica leaves the rule's choice."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from router_policies.policies.kv_aware import KvAware
from router_policies.policies.kv_aware_params import KvAwareParams
from router_policies.policies.kv_speed import speed_size
from router_policies.policy import FleetSnapshot, ReplicaState, RequestFeatures
from router_policies.ttft.features import REFERENCE_INPUTS, predict
from router_policies.ttft.params import NAMED_PRIORS

BS = 16
SHORT, LONG = 100, 1000  # prompts of 1,600 and 16,000 tokens (blocks), all held by "holder"


def req(blocks: int = SHORT) -> RequestFeatures:
    return RequestFeatures(
        model="m", block_keys=list(range(1, blocks + 1)), prompt_tokens=blocks * BS, block_size=BS
    )


def ms_per_token(blocks: int = SHORT) -> float:
    """The default prior's milliseconds per token at the request's size (kv_stall: queued_r)."""
    size = speed_size(blocks * BS)
    prior = NAMED_PRIORS[KvAwareParams().prior]
    return predict(prior, replace(REFERENCE_INPUTS, uncached_tokens=size)).total_ms / size


def fleet(
    age_ms: float, queued_tokens: int = 32, quiet: dict[str, object] | None = None, blocks: int = SHORT
) -> FleetSnapshot:
    """ "holder" holds the whole prompt with one request waiting ``age_ms``; "busy" holds nothing
    and has a request just dispatched; "quiet" holds nothing and nothing waits."""
    holder = ReplicaState(
        "holder",
        in_flight_requests=3,
        matched_blocks=blocks,
        pending_prefill_tokens=queued_tokens,
        pending_age_ms=age_ms,
    )
    busy = ReplicaState("busy", in_flight_requests=1, pending_prefill_tokens=16, pending_age_ms=0.5)
    return FleetSnapshot((holder, busy, ReplicaState("quiet", **{"in_flight_requests": 2, **(quiet or {})})))  # type: ignore[arg-type]


def test_a_stalled_holder_sends_the_request_where_nothing_waits() -> None:
    d = KvAware(KvAwareParams()).choose(req(), fleet(age_ms=800.0))
    assert (d.replica, d.reason) == ("quiet", "kv_aware:stall")
    assert d.scores["holder"] < d.scores["quiet"]  # the rule alone keeps the holder


def test_a_long_prompt_stays_where_its_recompute_outweighs_the_stall_so_far() -> None:
    """The move must cost less than the stalled pick plus its wait so far: 800 ms is fewer
    tokens at the prior's speed than a 16,000-token prompt recomputed elsewhere (4 x 16,000)."""
    stall_tokens = 800.0 / ms_per_token(LONG)
    assert stall_tokens < 4 * LONG * BS
    d = KvAware(KvAwareParams()).choose(req(LONG), fleet(800.0, blocks=LONG))
    assert (d.replica, d.reason) == ("holder", "kv_aware:cache")
    # stalled long enough for its recompute elsewhere, the move is worth it
    long_stall = 1.1 * 4 * LONG * BS * ms_per_token(LONG)
    d = KvAware(KvAwareParams()).choose(req(LONG), fleet(long_stall, blocks=LONG))
    assert (d.replica, d.reason) == ("quiet", "kv_aware:stall")


@pytest.mark.parametrize(
    "params, age_ms",
    [
        ({}, 499.0),  # younger than stall_ms (500)
        ({"stall_ms": 0.0}, 5_000.0),  # relief off
    ],
)
def test_a_young_wait_or_relief_off_keeps_the_holder(params: dict[str, float], age_ms: float) -> None:
    d = KvAware(KvAwareParams(**params)).choose(req(), fleet(age_ms))
    assert (d.replica, d.reason) == ("holder", "kv_aware:cache")


def test_a_wait_its_queued_prefill_explains_is_not_a_stall() -> None:
    """age >= stall_factor x queued_r is the line: a little less queued and it is a stall. (A
    long prompt and a 3 s wait: the queue that explains it is still cheaper than a miss.)"""
    age = 3_000.0
    explained = math.ceil(age / (KvAwareParams().stall_factor * ms_per_token(LONG)))
    d = KvAware(KvAwareParams()).choose(req(LONG), fleet(age, queued_tokens=explained, blocks=LONG))
    assert (d.replica, d.reason) == ("holder", "kv_aware:cache")
    d = KvAware(KvAwareParams()).choose(req(LONG), fleet(age, queued_tokens=explained - 2, blocks=LONG))
    assert (d.replica, d.reason) == ("quiet", "kv_aware:stall")


def test_with_no_quiet_replica_within_the_guard_the_choice_stands() -> None:
    # the quiet replica has a request waiting too (young): nothing is sure to admit at once
    d = KvAware(KvAwareParams()).choose(req(), fleet(800.0, quiet={"pending_age_ms": 3.0}))
    assert (d.replica, d.reason) == ("holder", "kv_aware:cache")
    # the quiet replica is over the hot-spot guard (1.5 x mean + 1): not a candidate
    d = KvAware(KvAwareParams(balance_abs=1.0)).choose(req(), fleet(800.0, quiet={"in_flight_requests": 9}))
    assert d.replica == "holder"


def test_a_quiet_replica_without_room_in_its_kv_cache_is_passed_over() -> None:
    """room_q: the quiet replica's requests in flight and this one must fit the KV capacity its
    model holds (the agent's report; here the prior's); a full one leaves the stalled pick."""
    capacity = NAMED_PRIORS[KvAwareParams().prior].kv_capacity_tokens
    full: dict[str, object] = {"in_flight_tokens": capacity - SHORT * BS + 1}
    d = KvAware(KvAwareParams()).choose(req(), fleet(800.0, quiet=full))
    assert (d.replica, d.reason) == ("holder", "kv_aware:cache")
    just: dict[str, object] = {"in_flight_tokens": capacity - SHORT * BS}
    d = KvAware(KvAwareParams()).choose(req(), fleet(800.0, quiet=just))
    assert (d.replica, d.reason) == ("quiet", "kv_aware:stall")


@pytest.mark.parametrize("rule", ["tokens", "ms"])
def test_stall_relief_is_the_stated_rule_on_random_fleets(rule: str) -> None:
    """Property: the choice is the quiet cheapest exactly when the rule's pick is stalled, a
    quiet replica within the guard exists and costs less than the pick plus the stall's wait so
    far (tokens at the pick's speed, or ms); otherwise it is the rule's own (stall_ms 0)."""
    rng = random.Random(7)
    moved = 0
    for _ in range(800):
        blocks = rng.choice([SHORT, LONG])
        reps = tuple(
            ReplicaState(
                f"r{i}",
                in_flight_requests=rng.randint(0, 6),
                matched_blocks=rng.choice([0, 0, blocks // 2, blocks]),
                pending_prefill_tokens=rng.choice([0, 16, 500, 5_000, 50_000]),
                pending_age_ms=rng.choice([0.0, 0.0, 2.0, 300.0, 700.0, 3_000.0, 20_000.0]),
                in_flight_tokens=rng.choice([0, 10_000, 390_000]),
            )
            for i in range(4)
        )
        snap = FleetSnapshot(reps)
        plain = KvAware(KvAwareParams(rule=rule, stall_ms=0.0)).choose(req(blocks), snap)
        got = KvAware(KvAwareParams(rule=rule)).choose(req(blocks), snap)
        pick = next(r for r in reps if r.id == plain.replica)
        loads = [r.in_flight_requests for r in reps]
        limit = 1.5 * sum(loads) / len(loads) + 32.0
        costs = [plain.scores[r.id] for r in reps]
        # room_q written out: the flights' KV and the whole prompt within the prior's capacity
        capacity = NAMED_PRIORS[KvAwareParams().prior].kv_capacity_tokens
        quiet_ok = [
            i
            for i, r in enumerate(reps)
            if r.pending_age_ms == 0 and loads[i] <= limit and r.in_flight_tokens + blocks * BS <= capacity
        ]
        quiet = min(quiet_ok, key=lambda i: (costs[i], i), default=None)
        mpt = ms_per_token(blocks)
        age = pick.pending_age_ms
        is_stalled = age >= 500.0 and age >= 2.0 * pick.pending_prefill_tokens * mpt
        wait = age / mpt if rule == "tokens" else age
        if is_stalled and quiet is not None and costs[quiet] < plain.scores[pick.id] + wait:
            assert (got.replica, got.reason) == (reps[quiet].id, "kv_aware:stall")
            assert reps[quiet].pending_age_ms == 0
            moved += 1
        else:
            assert (got.replica, got.reason) == (plain.replica, plain.reason)
    assert moved >= 10  # the property saw moves, not only choices left alone
