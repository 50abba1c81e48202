"""kv_aware's room first (router_policies/policies/kv_stall.py, "Room first"): a prompt no replica
holds goes to a replica whose KV cache holds it beside its requests in flight, when one within
the hot-spot guard does; a prompt held somewhere, or a fleet where none has room, keeps the rule's
choice."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from router_policies.policies.kv_aware import KvAware
from router_policies.policies.kv_aware_params import KvAwareParams
from router_policies.policy import FleetSnapshot, ReplicaState, RequestFeatures
from router_policies.ttft.params import NAMED_PRIORS

BS = 16
BLOCKS = 375  # a 6,000-token prompt
CAPACITY = 6_400  # KV tokens of each replica (a small engine: one such prompt at a time)
MODEL = replace(NAMED_PRIORS[KvAwareParams().prior], kv_capacity_tokens=CAPACITY)


def req(blocks: int = BLOCKS) -> RequestFeatures:
    return RequestFeatures(
        model="m", block_keys=list(range(1, blocks + 1)), prompt_tokens=blocks * BS, block_size=BS
    )


def rep(name: str, **kw: object) -> ReplicaState:
    return ReplicaState(name, ttft=MODEL, **kw)  # type: ignore[arg-type]


def fleet(**full: object) -> FleetSnapshot:
    """ "full": an empty cache, one request decoding whose KV leaves no room for a 6,000-token
    prompt; "roomy": a fuller cache, nothing in flight (the fill term alone prefers "full")."""
    return FleetSnapshot(
        (
            rep("full", in_flight_requests=1, in_flight_tokens=6_000, held_blocks=0, **full),
            rep("roomy", held_blocks=400),
        )
    )


def choose(snap: FleetSnapshot, blocks: int = BLOCKS, **params: object) -> str:
    return KvAware(KvAwareParams(**params)).choose(req(blocks), snap).replica


def test_a_prompt_held_nowhere_goes_where_the_kv_cache_has_room() -> None:
    assert choose(fleet(), room_first=False) == "full"  # what room first corrects
    d = KvAware(KvAwareParams()).choose(req(), fleet())  # on by default
    assert (d.replica, d.reason) == ("roomy", "kv_aware:room")
    assert choose(fleet(), blocks=20, room_first=True) == "full"  # a short prompt fits beside it


def test_a_prompt_held_somewhere_keeps_the_rules_choice() -> None:
    held = fleet(matched_blocks=BLOCKS)
    assert choose(held, room_first=True) == choose(held, room_first=False) == "full"


def test_with_no_room_anywhere_or_only_beyond_the_guard_the_choice_stands() -> None:
    snap = FleetSnapshot((*fleet().replicas[:1], rep("roomy", held_blocks=400, in_flight_tokens=6_000)))
    assert choose(snap, room_first=True) == choose(snap, room_first=False)
    # "roomy" over the hot-spot guard (1.5 x mean + 1 requests): not a candidate, room or not
    busy = FleetSnapshot((fleet().replicas[0], rep("roomy", held_blocks=400, in_flight_requests=9)))
    assert choose(busy, room_first=True, balance_abs=1.0) == "full"


@pytest.mark.parametrize("rule", ["tokens", "ms"])
def test_room_first_is_the_stated_rule_on_random_fleets(rule: str) -> None:
    """Property: a prompt held nowhere goes to the cheapest (by the rule's cost) replica within
    the guard whose in-flight KV plus the prompt fits its capacity, when there is one; any other
    request, or a fleet with none, gets the rule's own choice (room first off)."""
    rng = random.Random(11)
    moved = 0
    for _ in range(600):
        blocks = rng.choice([20, BLOCKS])
        reps = tuple(
            rep(
                f"r{i}",
                in_flight_requests=rng.randint(0, 4),
                in_flight_tokens=rng.choice([0, 0, 3_000, 6_000]),
                held_blocks=rng.choice([0, 100, 400]),
                pending_prefill_tokens=rng.choice([0, 0, 500, 6_000]),
                matched_blocks=rng.choice([0, 0, 0, blocks]),
            )
            for i in range(4)
        )
        snap = FleetSnapshot(reps)
        plain = KvAware(KvAwareParams(rule=rule, room_first=False, stall_ms=0.0)).choose(req(blocks), snap)
        got = KvAware(KvAwareParams(rule=rule, room_first=True, stall_ms=0.0)).choose(req(blocks), snap)
        loads = [r.in_flight_requests for r in reps]
        limit = 1.5 * sum(loads) / len(loads) + 32.0
        roomy = [
            i
            for i, r in enumerate(reps)
            if loads[i] <= limit and r.in_flight_tokens + blocks * BS <= CAPACITY
        ]
        held_nowhere = all(r.matched_blocks * BS < 0.1 * blocks * BS for r in reps)
        if held_nowhere and roomy:
            best = min(roomy, key=lambda i: plain.scores[reps[i].id])
            assert got.scores[got.replica] == plain.scores[reps[best].id]
            assert got.replica in {reps[i].id for i in roomy}
            moved += got.replica != plain.replica
            # its reason says when it passed over a cheaper replica (not a tie)
            assert (got.reason == "kv_aware:room") == (got.scores[got.replica] > plain.scores[plain.replica])
        else:
            assert (got.replica, got.reason) == (plain.replica, plain.reason)
    assert moved >= 10  # the property saw moves, not only choices left alone
