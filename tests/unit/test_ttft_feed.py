"""The TTFT model's feed (router_policies.placement.TtftFeed): inputs recorded when a flight
starts, the fit at its first byte, the audit sample, the fitted model on the next snapshot."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import numpy as np
import pytest

from router_policies import placement
from router_policies.placement import Candidate, Dispatch, FlightCounters, IndexView, ReplicaLoad, TtftFeed
from router_policies.policy import ReplicaState, RequestFeatures
from router_policies.prefix_index import MatchResult, PrefixIndex
from router_policies.ttft.features import TtftInputs, attention_pairs, predict
from router_policies.ttft.params import DEFAULT_PRIOR
from tests.unit.fleet_requests import NO_REQUEST


def _dispatch(state: ReplicaState, prompt: int = 1000, cached: int = 400) -> Dispatch:
    return Dispatch(state, prompt, cached, 16, 50)


def test_a_flight_counts_its_prefill_and_its_pairs_until_the_first_byte() -> None:
    c = FlightCounters()
    feed = TtftFeed()
    f = feed.flight(c, _dispatch(ReplicaState("r")), start=0.0)
    assert (c.requests, c.tokens, c.pending_prefill_tokens) == (1, 1050, 600)
    assert c.pending_prefill_pairs == attention_pairs(600, 400)
    f.first_byte(0.1)
    assert c.pending_prefill_tokens == 0 and c.pending_prefill_pairs == 0.0
    f.end()
    assert (c.requests, c.tokens) == (0, 0)


def test_the_first_byte_fits_the_replica_and_the_audit_hears_the_prediction() -> None:
    samples: list[placement.TtftSample] = []
    feed = TtftFeed(listener=samples.append)
    state = ReplicaState("r", pending_prefill_tokens=2000)
    for i in range(40):  # the replica is 3x slower than the prior says
        f = feed.flight(FlightCounters(), _dispatch(state), start=float(i))
        predicted = f.probe.predicted_ms if f.probe else 0.0
        truth = 3.0 * _prior_ms(state)
        sample = f.first_byte(i + truth / 1000)
        assert sample is not None and sample.predicted_ms == pytest.approx(predicted)
        assert f.first_byte(i + 1.0) is None  # once
    assert len(samples) == 40 and feed.params("r").observations == 40
    assert abs(samples[0].relative_error) > 0.5 and abs(samples[-1].relative_error) < 0.1
    assert feed.params("other") == feed.params("r")  # not answered yet: priced as its fitted peer
    assert TtftFeed().params("other") == DEFAULT_PRIOR  # no fitted peer: its prior


def _prior_ms(state: ReplicaState) -> float:
    probe = TtftFeed().flight(FlightCounters(), _dispatch(state), start=0.0).probe
    assert probe is not None
    return probe.predicted_ms


def test_a_flight_ended_without_a_first_byte_is_no_observation() -> None:
    feed = TtftFeed(clock=lambda: 5.0)
    f = feed.flight(FlightCounters(), _dispatch(ReplicaState("r")))
    f.end()
    assert feed.params("r").observations == 0


def test_the_snapshot_carries_the_fitted_model_and_the_pending_pairs() -> None:
    index = PrefixIndex()
    index.add_replica("r")
    feed = TtftFeed()
    f = feed.flight(FlightCounters(), _dispatch(ReplicaState("r")), start=0.0)
    f.first_byte(0.5)
    cand = Candidate("r", True, ReplicaLoad(pending_prefill_tokens=10), 123.0)
    snap = placement.snapshot([cand], IndexView({}, {}, index), ttft=feed.params)
    (r,) = snap.replicas
    assert r.ttft == feed.params("r") and r.ttft.observations == 1 and r.pending_prefill_pairs == 123.0
    assert placement.snapshot([cand], IndexView({}, {}, index)).replicas[0].ttft is None


def test_a_joining_replica_starts_from_its_peers_fit() -> None:
    feed = TtftFeed()
    for r, slow in (("a", 2.0), ("b", 3.0), ("c", 4.0)):
        for i in range(30):
            f = feed.flight(FlightCounters(), _dispatch(ReplicaState(r)), start=float(i))
            f.first_byte(i + slow * _prior_ms(ReplicaState(r)) / 1000)
    feed.adopt("d", ["a", "b", "c", "d"])
    # its own model (feed.params prices it as its fresh peers until it answers: freshness.unseen)
    assert feed.model.params("d").coefficients() == feed.params("b").coefficients()  # the median speed
    assert feed.model.params("d").observations == 0
    feed.adopt("e", [])  # no fitted peer: the prior
    assert feed.model.params("e") == DEFAULT_PRIOR


def test_the_dispatch_is_the_chosen_replica_as_the_decision_saw_it() -> None:
    index = PrefixIndex()
    for r in ("a", "b"):
        index.add_replica(r)
    cands = [Candidate("a", True, ReplicaLoad(in_flight_requests=3)), Candidate("b", True, ReplicaLoad())]
    snap = placement.snapshot(cands, IndexView({}, {}, index))
    d = Dispatch.of(snap.replicas[0], RequestFeatures("m", [], 100, 16), 32, 7)
    assert d.state.in_flight_requests == 3 and (d.prompt_tokens, d.cached_tokens, d.block_size) == (
        100,
        32,
        16,
    )


def test_the_gateway_fleet_feeds_the_model_and_exports_the_ttft_audit() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.config import parse_config
    from gateway.fleet import Fleet
    from gateway.metrics import GatewayMetrics

    now = [0.0]
    cfg = parse_config(
        {"models": [{"name": "m", "block_size": 16}], "replicas": [{"id": "a", "url": "http://a:1"}]}
    )
    index = PrefixIndex(cfg.index)
    fleet = Fleet(cfg, index, clock=lambda: now[0])
    fleet.check_result("a", True)
    metrics = GatewayMetrics(CollectorRegistry(), index, fleet, dict)
    rec = fleet.get("a")
    assert rec is not None
    snap = fleet.snapshot([rec], NO_REQUEST, MatchResult({}, {}))
    for _ in range(5):
        f = fleet.dispatch(rec, Dispatch.of(snap.replicas[0], RequestFeatures("m", [], 2000, 16), 0, 10))
        now[0] += 0.2
        f.first_byte()  # at the fleet's clock
        f.end()
    assert rec.ttft_audit.total == 5 and fleet.ttft.params("a").observations == 5
    assert fleet.snapshot([rec], NO_REQUEST, MatchResult({}, {})).replicas[0].ttft == fleet.ttft.params("a")
    mae = rec.ttft_audit.median_abs_error()
    described = cast(dict[str, Any], rec.describe()["ttft_audit"])
    assert mae is not None and described["total"] == 5 and described["median_abs_error"] == mae
    assert rec.ttft_model == fleet.ttft.params("a") and described["model"]["observations"] == 5
    assert described["model"]["calibration"] == round(fleet.ttft.params("a").calibration, 4) != 1.0
    text = generate_latest(metrics.registry).decode()
    assert 'kvgate_ttft_prediction_relative_error_count{replica="a"} 5.0' in text
    assert 'kvgate_ttft_prediction_median_abs_error{replica="a"}' in text


def test_the_fleets_prior_is_the_one_kv_aware_names() -> None:
    from gateway.config import parse_config
    from gateway.fleet import Fleet
    from router_policies.ttft.params import SMALL_CPU_PRIOR

    tree = {"models": [{"name": "m", "block_size": 16}], "replicas": [{"id": "a", "url": "http://a:1"}]}
    fleet = Fleet(parse_config(tree), PrefixIndex())
    assert fleet.ttft.params("a") == DEFAULT_PRIOR
    fleet.reconfigure(parse_config({**tree, "policy": {"kv_aware": {"prior": "small-cpu"}}}))
    assert fleet.ttft.params("a") == SMALL_CPU_PRIOR


def test_the_engines_kv_capacity_from_its_agent_enters_the_model() -> None:
    from gateway.config import parse_config
    from gateway.fleet import Fleet
    from gateway.inventory_sink import AgentHello

    cfg = parse_config(
        {"models": [{"name": "m", "block_size": 16}], "replicas": [{"id": "a", "url": "http://a:1"}]}
    )
    fleet = Fleet(cfg, PrefixIndex(cfg.index))
    assert fleet.ttft.params("a").kv_capacity_tokens == DEFAULT_PRIOR.kv_capacity_tokens
    hello = AgentHello("a", "http://a:1", ("m",), 16, 400, "vllm", "0", "1")
    assert fleet.agent_hello(hello) is None
    assert fleet.ttft.params("a").kv_capacity_tokens == 6400
    fleet.ttft.model.observe_first_token("a", TtftInputs(0, 0, 0, 100, 0), 50.0)
    fitted = fleet.ttft.params("a")
    assert fleet.agent_hello(hello) is None  # the same capacity again: the fit stays
    assert fleet.ttft.params("a") == fitted
    fleet.ttft.set_kv_capacity("a", 3200)  # another: the fit so far is the new prior
    assert fleet.ttft.params("a").coefficients() == fitted.coefficients()
    assert fleet.ttft.params("a").kv_capacity_tokens == 3200 and fleet.ttft.params("a").observations == 0


def test_cached_blocks_several_flights_share_are_counted_once_and_the_snapshot_carries_them() -> None:
    from gateway.config import parse_config
    from gateway.fleet import Fleet

    tree = {"models": [{"name": "m", "block_size": 16}], "replicas": [{"id": "r", "url": "http://r:1"}]}
    fleet = Fleet(parse_config(tree), PrefixIndex(), clock=lambda: 0.0)
    rec = fleet.get("r")
    assert rec is not None
    c = rec.flights
    keys = list(range(100, 200))  # 100 blocks of 16 tokens

    def go(cached_blocks: int, prompt_keys: list[int]) -> placement.Flight:
        d = Dispatch(ReplicaState("r"), 16 * len(prompt_keys), 16 * cached_blocks, 16, 50, prompt_keys)
        return fleet.dispatch(rec, d)

    a = go(40, keys[:60])  # 40 blocks cached
    b = go(25, keys[:30])  # 25 of the same blocks: counted once already
    other = go(10, [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18])  # a different prefix
    assert c.shared_tokens == 25 * 16
    # the decision's snapshot, as the router takes it, carries the figure
    assert (
        fleet.snapshot([rec], NO_REQUEST, MatchResult({}, {})).replicas[0].in_flight_shared_tokens == 25 * 16
    )
    a.first_byte(0.1)
    assert c.shared_tokens == 25 * 16  # held until the request ends: its KV stays pinned
    a.end()
    assert c.shared_tokens == 0  # b alone holds those blocks now
    b.end()
    other.end()
    assert (c.tokens, c.shared_tokens) == (0, 0)


def test_the_pending_age_is_the_wait_of_the_oldest_request_without_a_first_byte() -> None:
    c = FlightCounters()
    feed = TtftFeed()
    assert c.pending_age_ms(5.0) == 0.0
    first = feed.flight(c, _dispatch(ReplicaState("r")), start=1.0)
    second = feed.flight(c, _dispatch(ReplicaState("r")), start=1.5)
    assert c.pending_age_ms(2.0) == pytest.approx(1000.0)
    first.first_byte(2.0)  # the head got its first token: the next one is the oldest
    assert c.pending_age_ms(2.0) == pytest.approx(500.0)
    second.end()  # failed before its first byte: no longer waiting
    assert c.pending_age_ms(2.0) == 0.0
    # the snapshot carries it, and the TTFT model predicts a longer wait behind an old head
    fresh = ReplicaState("r", pending_prefill_tokens=100)
    stuck = dataclasses.replace(fresh, pending_age_ms=2000.0)
    d_fresh, d_stuck = _dispatch(fresh), _dispatch(stuck)
    p_fresh = feed.flight(FlightCounters(), d_fresh, start=0.0).probe
    p_stuck = feed.flight(FlightCounters(), d_stuck, start=0.0).probe
    assert p_fresh is not None and p_stuck is not None
    # (the one first token fitted above moved the replica's median calibration one step)
    assert p_stuck.predicted_ms == pytest.approx(
        p_fresh.predicted_ms + 2000.0 * DEFAULT_PRIOR.queue_age_ratio * feed.params("r").calibration
    )


def test_a_noisy_fit_is_still_routed_on_when_the_prior_predicts_worse() -> None:
    """First tokens 4x faster than the prior says, with a heavy multiplicative noise: the fit's
    error scale exceeds MAX_ERROR_RATIO, but the prior's on the same first tokens is larger, so
    the policy keeps the fit (before, it fell back to the 4x-wrong prior)."""
    rng = np.random.default_rng(3)
    feed = TtftFeed()
    for _ in range(300):
        state = ReplicaState("r", pending_prefill_tokens=int(rng.integers(0, 20_000)))
        f = feed.flight(
            FlightCounters(), _dispatch(state, prompt=int(rng.integers(100, 4000)), cached=0), start=0.0
        )
        assert f.probe is not None
        truth = predict(DEFAULT_PRIOR, f.probe.inputs).total_ms / 4
        f.first_byte(truth * float(np.exp(rng.normal(0, 0.9))) / 1000.0)
    fitted = feed.model.params("r")
    assert fitted.error_ratio > placement.MAX_ERROR_RATIO
    assert feed.model.prior_error("r") > fitted.error_ratio
    assert feed.params("r") is fitted
