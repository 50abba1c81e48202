"""kv_aware's room soonest (router_policies/policies/kv_stall.py, "Room soonest"): when no replica
within the hot-spot guard has room for a prompt no replica holds, it goes to the one whose flights
are expected to free the room soonest; the schedule it reads (FlightCounters.room_schedule) and
when placement works it out."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from router_policies.flights import FlightCounters
from router_policies.placement import Candidate, Flight, IndexView, ReplicaLoad, snapshot
from router_policies.policies.kv_aware import KvAware
from router_policies.policies.kv_aware_params import KvAwareParams
from router_policies.policies.kv_stall import room_wait_ms
from router_policies.policy import FleetSnapshot, ReplicaState, RequestFeatures, RoomSchedule
from router_policies.prefix_index import PrefixIndex
from router_policies.ttft.params import NAMED_PRIORS

BS = 16
BLOCKS = 375  # a 6,000-token prompt
CAPACITY = 6_400
MODEL = replace(NAMED_PRIORS[KvAwareParams().prior], kv_capacity_tokens=CAPACITY)


def req(blocks: int = BLOCKS) -> RequestFeatures:
    return RequestFeatures(
        model="m", block_keys=list(range(1, blocks + 1)), prompt_tokens=blocks * BS, block_size=BS
    )


def rep(name: str, ends: tuple[tuple[float, int], ...] | None = None, **kw: object) -> ReplicaState:
    """``ends``: (ms until it ends, KV it frees) of each flight decoding, at a pace of 1 ms a
    token (None: no schedule)."""
    plan = None if ends is None else RoomSchedule(1.0, tuple((0.0, int(ms) + 1, kv) for ms, kv in ends))
    return ReplicaState(name, ttft=MODEL, room_schedule=plan, **kw)  # type: ignore[arg-type]


def paced(counters: FlightCounters, s_per_token: float) -> FlightCounters:
    """``counters`` with a pace measured: one stream of 11 tokens read to its end."""
    f = Flight(counters, 11, 0, output=11)
    f.first_byte(0.0)
    f.end(10 * s_per_token)
    return counters


# ---------------------------------------------------------------------- the schedule
def test_the_schedule_is_each_flights_progress_and_what_it_frees() -> None:
    c = FlightCounters()
    Flight(c, 1_100, 1_000, output=100)
    assert c.room_schedule(0.0) == RoomSchedule(0.0, (), ((100, 1_100, 1_000),))  # no pace yet
    paced(c, 0.01)  # 10 ms a token
    decoding = Flight(c, 2_100, 2_000, output=100)
    decoding.first_byte(1.0)
    Flight(c, 600, 500, output=0)  # no expected output: no known end
    Flight(c, 300, 200, output=20)
    got = c.room_schedule(1.5)
    assert got.pace_ms == pytest.approx(10.0)
    assert [(round(ms, 6), out, kv) for ms, out, kv in got.running] == [(500.0, 100, 2_100)]
    assert got.waiting == ((100, 1_100, 1_000), (20, 300, 200))  # in the order sent


def test_a_flights_end_frees_none_of_the_cached_prefix_another_flight_holds() -> None:
    c = paced(FlightCounters(), 0.01)
    prefix = [1, 2, 3, 4]
    for n, output in ((4, 100), (2, 50)):
        f = Flight(c, 1_000, 1_000 - n * BS, cached_keys=prefix[:n], block_size=BS, output=output)
        f.first_byte(0.0)
    # each frees its prompt and output less the 2 blocks the other also holds
    assert [kv for _ms, _out, kv in c.room_schedule(0.0).running] == [1_000 - 2 * BS] * 2


# ---------------------------------------------------------------------- the wait
def test_the_wait_is_when_the_flights_in_end_order_have_freed_what_the_prompt_lacks() -> None:
    prompt = BLOCKS * BS  # lacks 3,000 + 6,000 - 6,400 = 2,600 tokens
    r = rep("a", ((100.0, 1_000), (250.0, 2_000), (900.0, 3_000)), in_flight_tokens=3_000)
    assert room_wait_ms(r, prompt, MODEL, 0.1) == 250.0
    assert room_wait_ms(rep("a", ((100.0, 1_000),), in_flight_tokens=3_000), prompt, MODEL, 0.1) == math.inf
    assert room_wait_ms(rep("b", in_flight_tokens=400), prompt, MODEL, 0.1) == 0.0  # room now
    assert room_wait_ms(rep("c", in_flight_tokens=6_000), prompt, MODEL, 0.1) == math.inf  # no schedule


def test_a_decodes_end_is_its_output_at_the_pace_after_its_first_token() -> None:
    def wait(pace_ms: float, since_ms: float) -> float:
        plan = RoomSchedule(pace_ms, ((since_ms, 101, 6_000),))
        return room_wait_ms(ReplicaState("a", in_flight_tokens=6_000, room_schedule=plan), 1_000, MODEL, 0.1)

    assert wait(10.0, 0.0) == 1_000.0  # 100 tokens left at 10 ms
    assert wait(10.0, 400.0) == 600.0
    assert wait(10.0, 5_000.0) == 10.0  # past its expected end: one token's time from now
    # no pace measured: the model's step with one sequence decoding
    assert wait(0.0, 0.0) == pytest.approx(100 * (MODEL.step_ms + MODEL.decode_ms_per_seq))


def test_those_waiting_ahead_are_admitted_first_and_hold_their_room_until_they_end() -> None:
    # 7,000 in flight: 4,000 decoding (ends in 100 ms), 3,000 waiting (1,000 prefill tokens at
    # 0.1 ms, then 50 tokens at 10 ms): the waiting one is admitted when the decode ends and
    # frees its room at 100 + 100 + 500 ms
    plan = RoomSchedule(10.0, ((0.0, 11, 4_000),), ((50, 3_000, 1_000),))
    r = ReplicaState("a", ttft=MODEL, in_flight_tokens=7_000, room_schedule=plan)
    assert room_wait_ms(r, 4_000, MODEL, 0.1) == 700.0
    # a prompt that fits beside the waiting one goes in with it
    assert room_wait_ms(r, 3_000, MODEL, 0.1) == 100.0


# ---------------------------------------------------------------------- the rule
def test_with_no_room_anywhere_a_cold_prompt_goes_where_room_comes_soonest() -> None:
    soon = rep("soon", ((300.0, 6_000),), in_flight_requests=1, in_flight_tokens=6_000, held_blocks=400)
    late = rep("late", ((2_000.0, 6_000),), in_flight_requests=1, in_flight_tokens=6_000)
    snap = FleetSnapshot((late, soon))
    assert KvAware(KvAwareParams(room_soonest=False)).choose(req(), snap).replica == "late"  # fill term
    d = KvAware(KvAwareParams()).choose(req(), snap)
    assert (d.replica, d.reason) == ("soon", "kv_aware:room")
    assert (d.terms["soon"]["room_wait_ms"], d.terms["late"]["room_wait_ms"]) == (300.0, 2_000.0)  # explain
    # a prompt held somewhere keeps the rule's choice
    held = FleetSnapshot((replace(late, matched_blocks=BLOCKS), soon))
    assert KvAware(KvAwareParams()).choose(req(), held).replica == "late"


def test_a_replica_whose_wait_is_not_known_leaves_the_choice_to_the_rule() -> None:
    soon = rep("soon", ((300.0, 6_000),), in_flight_requests=1, in_flight_tokens=6_000, held_blocks=400)
    unknown = rep("unknown", None, in_flight_requests=1, in_flight_tokens=6_000)  # no schedule
    snap = FleetSnapshot((unknown, soon))
    d = KvAware(KvAwareParams()).choose(req(), snap)
    assert (d.replica, d.reason) == ("unknown", "kv_aware:load")  # the fill term's choice
    assert "room_wait_ms" not in d.terms["unknown"] and d.terms["soon"]["room_wait_ms"] == 300.0


def test_waits_within_the_band_are_left_to_the_rules_cost() -> None:
    # "near" waits 10 % longer than "soon" but its cache is emptier (the fill term prefers it)
    near = rep("near", ((330.0, 6_000),), in_flight_requests=1, in_flight_tokens=6_000)
    soon = rep("soon", ((300.0, 6_000),), in_flight_requests=1, in_flight_tokens=6_000, held_blocks=400)
    snap = FleetSnapshot((soon, near))
    assert KvAware(KvAwareParams()).choose(req(), snap).replica == "near"  # band 1.2
    assert KvAware(KvAwareParams(soonest_band=1.05)).choose(req(), snap).replica == "soon"


def _random_replica(rng: random.Random, name: str, blocks: int) -> ReplicaState:
    """A replica short of room for most prompts, with a schedule of two decodes (or none)."""
    ends = sorted((rng.choice([50.0, 400.0, 3_000.0]), rng.choice([500, 3_000, 6_000])) for _ in range(2))
    return rep(
        name,
        tuple(ends) if rng.random() < 0.95 else None,
        in_flight_requests=rng.randint(0, 4),
        in_flight_tokens=rng.choice([3_000, 6_000, 6_000]),
        held_blocks=rng.choice([0, 100, 400]),
        matched_blocks=rng.choice([0, 0, 0, blocks]),
    )


@pytest.mark.parametrize("rule", ["tokens", "ms"])
def test_room_soonest_is_the_stated_rule_on_random_fleets(rule: str) -> None:
    """Property: where room first finds no room within the guard for a prompt held nowhere, the
    choice is the cheapest replica within the guard whose wait is within soonest_band of the
    least, when every wait within the guard is finite; with one not known, or any other case,
    the choice of room soonest off."""
    rng = random.Random(12)
    moved = 0
    for blocks in rng.choices([20, BLOCKS], k=1_500):
        reps = tuple(_random_replica(rng, f"r{i}", blocks) for i in range(4))
        snap = FleetSnapshot(reps)
        plain = KvAware(KvAwareParams(rule=rule, room_soonest=False, stall_ms=0.0)).choose(req(blocks), snap)
        got = KvAware(KvAwareParams(rule=rule, stall_ms=0.0)).choose(req(blocks), snap)
        loads = [r.in_flight_requests for r in reps]
        limit = 1.5 * sum(loads) / len(loads) + 32.0
        guarded = [i for i in range(4) if loads[i] <= limit]
        room = [i for i in guarded if reps[i].in_flight_tokens + blocks * BS <= CAPACITY]
        per_token = KvAware(KvAwareParams())._reference_ms(MODEL, 8_192) / 8_192
        waits = {i: room_wait_ms(reps[i], blocks * BS, MODEL, per_token) for i in guarded}
        held_nowhere = all(r.matched_blocks * BS < 0.1 * blocks * BS for r in reps)
        if held_nowhere and not room and max(waits.values()) < math.inf:
            first = min(waits.values())
            soonest = [i for i in guarded if waits[i] <= KvAwareParams().soonest_band * first]
            best = min(soonest, key=lambda i: plain.scores[reps[i].id])
            assert got.scores[got.replica] == plain.scores[reps[best].id]
            assert got.replica in {reps[i].id for i in soonest}
            moved += got.replica != plain.replica
        else:
            assert (got.replica, got.reason) == (plain.replica, plain.reason)
    assert moved >= 10


# ---------------------------------------------------------------------- placement
def test_placement_asks_for_the_schedule_only_when_the_prompt_may_not_fit() -> None:
    asked: list[str] = []
    plan = RoomSchedule(1.0, ((0.0, 11, 100),))

    def schedule(name: str) -> RoomSchedule:
        asked.append(name)
        return plan

    index = PrefixIndex()
    keys = list(range(1, 101))  # 1,600 tokens
    view = IndexView({}, {}, index, keys, BS)
    cands = [
        Candidate("full", True, ReplicaLoad(1, 5_000), room_schedule=lambda: schedule("full")),
        Candidate("free", True, ReplicaLoad(1, 4_000), room_schedule=lambda: schedule("free")),
    ]
    snap = snapshot(cands, view, ttft=lambda _r: MODEL)
    assert asked == ["full"]  # 5,000 + 1,616 > 6,400; 4,000 + 1,616 fits
    assert [r.room_schedule for r in snap.replicas] == [plan, None]
    assert snapshot(cands, view).replicas[0].room_schedule is None  # no model: no capacity known
