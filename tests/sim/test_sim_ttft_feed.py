"""The simulator feeds the TTFT model as the gateway does (placement.TtftFeed through
SimGateway): each replica starts from its engine's prior, every first token is fitted, and a
heterogeneous fleet (one engine per replica) runs through the same code."""

from __future__ import annotations

import dataclasses
import math

import pytest

from router_policies.sim.profiles import fleet_profiles
from router_policies.sim.simulator import (
    SimFleet,
    engine_ttft_prior,
    fleet_engines,
    prepare,
    scaled_arrivals,
    simulate,
)
from router_policies.sim.workloads import AgentSpec, agent_trace

REPLICAS = 4


def _run(policy: str, load: float = 0.6) -> tuple[float, float]:
    trace = agent_trace(dataclasses.replace(AgentSpec(), sessions=30), seed=1)
    engines = [p.engine_config(trace.block_size) for p in fleet_profiles("h100+a100", REPLICAS)]
    prep = prepare(trace)
    arr = scaled_arrivals(prep, load, REPLICAS, engines)
    res = simulate(prep, SimFleet(REPLICAS, engines), (policy, None), load, arr)
    return res.ttft_p99_ms, res.ttft_audit_median_abs_error


def test_a_heterogeneous_fleet_is_simulated_and_its_models_fitted() -> None:
    p99, audit = _run("kv_aware")
    assert math.isfinite(p99) and p99 > 0
    # the engine model and the TTFT model share their cost formula: the fit predicts it closely
    assert audit < 0.2, audit


def test_kv_aware_tail_is_no_worse_than_round_robin_on_the_mixed_fleet() -> None:
    assert _run("kv_aware")[0] <= _run("round_robin")[0]


def test_fleet_engines_and_priors() -> None:
    trace = agent_trace(dataclasses.replace(AgentSpec(), sessions=2), seed=1)
    h100, a100 = (p.engine_config(trace.block_size) for p in fleet_profiles("h100+a100", 2))
    assert fleet_engines(h100, 3) == [h100] * 3
    with pytest.raises(ValueError):
        fleet_engines([h100, a100], 3)
    assert engine_ttft_prior(a100).prefill_ms_per_token > engine_ttft_prior(h100).prefill_ms_per_token
