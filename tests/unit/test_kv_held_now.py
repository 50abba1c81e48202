"""The KV a replica's requests hold now (router_policies.ttft.features, "X";
flights.FlightCounters.unproduced_tokens; placement.IndexView.pinned):
exact cases of the formulas as their docstrings state them, and the placement glue's
bisection against the plain scan it replaced."""

from __future__ import annotations

import dataclasses
import random

import pytest

from router_policies import placement
from router_policies.flights import PACE_WEIGHT, Flight, FlightCounters
from router_policies.placement import Candidate, IndexView, ReplicaLoad
from router_policies.policy import ReplicaState
from router_policies.ttft.features import TtftInputs, kv_excess_now
from router_policies.ttft.params import DEFAULT_PRIOR
from router_policies.ttft.snapshot import inputs_for
from tests.unit.test_invariants_index import ChainTree, index_of

BS = 16


def _flight(c: FlightCounters, output: int, tokens: int = 1000, cached_keys: tuple[int, ...] = ()) -> Flight:
    return Flight(c, tokens, 0, cached_keys=cached_keys, block_size=BS, output=output)


def test_outputs_not_yet_decoded_follow_the_replicas_measured_pace() -> None:
    c = FlightCounters()
    first = _flight(c, output=101)
    first.first_byte(1.0)
    assert c.unproduced_tokens(1.5) == 101 - 101 // 2  # no pace measured yet: half decoded
    first.end(2.0)  # 100 tokens after the first in 1 s
    assert c.s_per_output_token == pytest.approx(0.01)
    assert (c.output_tokens, c.unproduced_tokens(2.0)) == (0, 0)

    decoding = _flight(c, output=51)
    waiting = _flight(c, output=40)  # no first byte: nothing decoded
    decoding.first_byte(3.0)
    assert c.output_tokens == 91
    assert c.unproduced_tokens(3.0) == 91 - 1  # the first token came with the first byte
    assert c.unproduced_tokens(3.2) == 91 - 21  # 1 + 0.2 s / 0.01 s
    assert c.unproduced_tokens(60.0) == 40  # at most its whole output
    decoding.end(3.0 + 50 * 0.02)  # a stream at 0.02 s per token moves the average by its weight
    assert c.s_per_output_token == pytest.approx(0.01 + PACE_WEIGHT * 0.01)
    waiting.end()
    assert (c.output_tokens, c.unproduced_tokens(99.0)) == (0, 0)


def test_only_a_stream_read_to_its_end_after_a_timed_first_byte_measures_the_pace() -> None:
    c = FlightCounters()
    cut = _flight(c, output=50)
    cut.first_byte(1.0)
    cut.end()  # cut, or a body: no time given
    untimed = _flight(c, output=50)
    untimed.first_byte()  # no probe, no time: not counted as decoding
    assert c.unproduced_tokens(5.0) == 50
    untimed.end(9.0)
    one = _flight(c, output=1)
    one.first_byte(1.0)
    one.end(2.0)  # a single token has no pace
    assert c.s_per_output_token == 0.0


def test_the_kv_demand_counts_what_is_held_now_and_this_prompts_new_blocks() -> None:
    base = TtftInputs(
        queued_prefill_tokens=0, decoding=3, kv_tokens=6000, uncached_tokens=300, cached_tokens=700
    )
    assert kv_excess_now(base, 1000, 6400) == 600  # every output counted, nothing shared
    held_now = dataclasses.replace(base, unproduced_kv_tokens=500, shared_kv_tokens=200)
    assert kv_excess_now(held_now, 1000, 6000) == 6000 - 500 - 200 + 1000 - 6000
    pinned = dataclasses.replace(held_now, pinned_tokens=700)  # its cached prefix is held already
    assert kv_excess_now(pinned, 1000, 6000) == 0
    assert kv_excess_now(dataclasses.replace(base, unproduced_kv_tokens=9000), 1000, 6400) == 0


def _linear_run(a: list[int], b: list[int], limit: int) -> int:
    n = min(limit, len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def test_the_shared_run_by_bisection_is_the_plain_scans() -> None:
    for seed in range(30):
        rng = random.Random(seed)
        tree = ChainTree(rng, 40)
        for _ in range(40):
            a, b = tree.path(rng.choice(tree.keys)), tree.path(rng.choice(tree.keys))
            limit = rng.randint(0, 12)
            assert placement._shared_run(a, b, limit) == _linear_run(a, b, limit)


def test_pinned_blocks_are_read_only_when_the_kv_could_be_short() -> None:
    index = index_of(("r",))
    keys = list(range(100, 110))
    flights = [[*keys[:6], 900], keys[:3]]
    params = dataclasses.replace(DEFAULT_PRIOR, kv_capacity_tokens=900)
    view = IndexView({"r": 8}, {"r": 8.0}, index, keys, BS)

    def state(tokens: int, unproduced: int) -> ReplicaState:
        cand = Candidate("r", True, ReplicaLoad(2, tokens, 880), 0.0, 0, 0.0, flights, unproduced)
        (s,) = placement.snapshot([cand], view, ttft=lambda _: params).replicas
        # the pinned blocks worked out once serve the eviction estimate as its own would
        assert s.evicted_blocks == view.evicted(cand, 900) > 0
        return s

    short = state(900, 100)  # 800 held now + (10 + 1) x 16 for this prompt > 900
    assert (short.pinned_blocks, short.in_flight_unproduced_tokens) == (6, 100)
    inputs = inputs_for(short, 10 * BS, 8 * BS, BS, params)
    assert (inputs.unproduced_kv_tokens, inputs.pinned_tokens) == (100, 6 * BS)
    assert inputs_for(short, 10 * BS, 4 * BS, BS, params).pinned_tokens == 4 * BS  # at most cached
    roomy = state(900, 700)  # 200 held now: room for the prompt whatever it shares
    assert roomy.pinned_blocks == 0
