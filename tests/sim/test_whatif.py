"""``kvgate whatif`` on a trace in the recorder's format: the current fleet and its variations run
through the same simulator as ``kvgate compare``, at the recorded arrival times."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gateway.cli import main
from router_policies.errors import UserInputError
from router_policies.sim.simulator import prepare
from router_policies.sim.traces import load_trace, write_trace
from router_policies.sim.whatif import (
    FleetModel,
    engine_of,
    replicas_for_target,
    run_scenario,
    variations,
    whatif,
)
from router_policies.sim.workloads import AgentSpec, agent_trace

SPEC = AgentSpec(
    tenants=4, sessions=24, session_rate_per_s=2.0, mean_turns=4.0, max_turns=8, gap_median_s=5.0
)


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    trace = agent_trace(SPEC, seed=3)
    path = tmp_path_factory.mktemp("whatif") / "recorded.jsonl"
    write_trace(path, trace.requests, trace.block_size)
    return path


def _fleet(cache_blocks: int) -> FleetModel:
    return FleetModel(
        2, engine_of("llama3-8b-h100", SPEC.block_size, cache_blocks, 1.0, None), "kv_aware", {}
    )


def test_more_cache_never_lowers_the_hit_rate_and_another_policy_differs(trace_path: Path) -> None:
    prep = prepare(load_trace(trace_path))
    fleet = _fleet(cache_blocks=300)
    rows = whatif(prep, fleet, variations("2x-cache,4x-cache,policy=round_robin", fleet), seed=0)
    by = {r["scenario"]: r for r in rows}
    assert list(by) == ["current fleet", "2x-cache", "4x-cache", "policy=round_robin"]
    assert by["2x-cache"]["cache_blocks"] == 600
    assert by["current fleet"]["hit_rate"] <= by["2x-cache"]["hit_rate"] <= by["4x-cache"]["hit_rate"]
    assert by["4x-cache"]["hit_rate"] > by["current fleet"]["hit_rate"]
    assert by["policy=round_robin"]["hit_rate"] < by["current fleet"]["hit_rate"]
    # deterministic: the same inputs give the same rows
    assert whatif(prep, fleet, [], seed=0)[0] == rows[0]


def test_replicas_for_a_ttft_target(trace_path: Path) -> None:
    prep = prepare(load_trace(trace_path))
    fleet = FleetModel(2, engine_of("llama3-8b-h100", SPEC.block_size, 300, 20.0, None), "kv_aware", {})
    base = whatif(prep, fleet, [], seed=0)[0]
    goal = base["ttft_p99_ms"] * 0.7  # met by 5 of at most 8 replicas (0.6x: by none since 2 do better)
    target = replicas_for_target(prep, fleet, goal, seed=0)
    n = target["replicas"]
    assert n is not None and n > 2 and target["row"]["ttft_p99_ms"] <= goal
    # the fewest: one replica less misses the target
    fewer = run_scenario(prep, fleet, dataclasses.replace(fleet.baseline(), replicas=n - 1), seed=0)
    assert fewer["ttft_p99_ms"] > goal
    # a target the smallest fleet meets: 1 replica
    assert replicas_for_target(prep, fleet, base["ttft_p99_ms"] * 10, seed=0)["replicas"] == 1


def test_cli_table_json_and_errors(
    trace_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "w.json"
    rc = main(["whatif", "--trace", str(trace_path), "--replicas", "2", "--cache-blocks", "300",
               "--vary", "2x-replicas,policy=least_loaded", "--json", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "current fleet" in text and "2x-replicas" in text
    doc = json.loads(out.read_text())
    assert [r["replicas"] for r in doc["rows"]] == [2, 4, 2]
    with pytest.raises(UserInputError, match="unknown variation"):
        variations("3x-gpus", _fleet(300))
    assert main(["whatif", "--trace", str(trace_path), "--replicas", "2", "--vary", "bogus"]) == 2
