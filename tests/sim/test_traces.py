"""Trace loading and writing, and the workload generators."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from router_policies.sim.traces import TraceError, TraceRequest, load_trace, write_trace
from router_policies.sim.workloads import AgentSpec, GroupsSpec, agent_sessions, agent_trace, group_requests

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"

GOOD = {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}


def write_lines(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def test_loads_a_mooncake_line(tmp_path: Path) -> None:
    tr = load_trace(write_lines(tmp_path, [json.dumps(GOOD)]))
    assert tr.block_size == 512
    (r,) = tr.requests
    assert (r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) == (0.0, 1100, 5, (1, 2, 3))
    assert list(tr.full_block_ids(r)) == [1, 2]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "trace.jsonl:2: not valid JSON"),
        ("[1, 2]", "trace.jsonl:2: expected a JSON object"),
        (
            json.dumps({**GOOD, "input_length": -3}),
            "trace.jsonl:2: input_length: expected a positive integer",
        ),
        (
            json.dumps({**GOOD, "input_length": "12"}),
            "trace.jsonl:2: input_length: expected a positive integer",
        ),
        (
            json.dumps({**GOOD, "output_length": 1.5}),
            "trace.jsonl:2: output_length: expected a non-negative integer",
        ),
        (json.dumps({**GOOD, "timestamp": -1}), "trace.jsonl:2: timestamp: expected a non-negative number"),
        (json.dumps({**GOOD, "hash_ids": [1, "x"]}), "trace.jsonl:2: hash_ids: expected a list of integers"),
        (json.dumps({**GOOD, "hash_ids": [1]}), "trace.jsonl:2: hash_ids: 1 ids for 1100 tokens"),
        (json.dumps({**GOOD, "hash_ids": [1, 2, 3, 4]}), "trace.jsonl:2: hash_ids: 4 ids for 1100 tokens"),
        (json.dumps({**GOOD, "block_size": 0}), "trace.jsonl:2: block_size: expected a positive integer"),
        (json.dumps({**GOOD, "block_size": 64}), "trace.jsonl:2: block_size: 64 differs from the 512"),
        (json.dumps({**GOOD, "session_id": 7}), "trace.jsonl:2: session_id: expected a string"),
    ],
)
def test_bad_lines_name_the_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    p = write_lines(tmp_path, [json.dumps(GOOD), line])
    with pytest.raises(TraceError) as exc:
        load_trace(p)
    assert message in str(exc.value)


def test_out_of_order_and_empty_traces_are_refused(tmp_path: Path) -> None:
    p = write_lines(tmp_path, [json.dumps({**GOOD, "timestamp": 10}), json.dumps(GOOD)])
    with pytest.raises(TraceError, match=r"trace.jsonl:2: timestamp: 0 is earlier"):
        load_trace(p)
    with pytest.raises(TraceError, match="holds no requests"):
        load_trace(write_lines(tmp_path, [""]))
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")


def test_write_then_load_round_trips(tmp_path: Path) -> None:
    reqs = [TraceRequest(0.0, 130, 4, (7, 8), "s1"), TraceRequest(12.5, 64, 0, (9,), None)]
    write_trace(tmp_path / "t.jsonl", reqs, block_size=64)
    tr = load_trace(tmp_path / "t.jsonl")
    assert tr.block_size == 64
    assert tr.requests == tuple(reqs)


def test_shared_traces_load() -> None:
    conv = SHARED / "mooncake_conversation_trace.jsonl"
    if not conv.exists():
        pytest.skip("shared traces not present")
    tr = load_trace(conv)
    assert len(tr.requests) == 12_031
    assert all(r.hash_ids[0] == 0 for r in tr.requests)


def small_agent() -> AgentSpec:
    return AgentSpec(tenants=3, sessions=12, mean_turns=4.0, max_turns=8)


def test_agent_sessions_are_seeded_and_grow_their_transcript() -> None:
    a = list(agent_sessions(small_agent(), 5))
    assert a == list(agent_sessions(small_agent(), 5))
    assert a != list(agent_sessions(small_agent(), 6))
    tr = agent_trace(small_agent(), 5)
    by_session: dict[str, list[TraceRequest]] = {}
    for r in tr.requests:
        assert r.session_id is not None
        by_session.setdefault(r.session_id, []).append(r)
    assert len(by_session) == 12
    bs = tr.block_size
    for turns in by_session.values():
        for prev, cur in itertools.pairwise(turns):
            # every turn resends the previous prompt (and more): its full blocks are a prefix
            assert cur.input_length > prev.input_length
            assert cur.hash_ids[: prev.input_length // bs] == prev.hash_ids
    # sessions of one tenant share the head's blocks; other tenants do not
    firsts = {s.session_id: s for s in a}
    heads: dict[int, set[int]] = {}
    for sid, turns in by_session.items():
        heads.setdefault(firsts[sid].tenant, set()).add(turns[0].hash_ids[0])
    assert all(len(v) == 1 for v in heads.values())
    assert len({next(iter(v)) for v in heads.values()}) == len(heads)


def test_groups_share_exactly_their_prefix() -> None:
    spec = GroupsSpec(groups=3, prompts_per_group=5, prefix_tokens=640)
    tr = group_requests(spec, 1)
    assert tr == group_requests(spec, 1)
    assert len(tr.requests) == 15
    prefix_blocks = 640 // spec.block_size
    groups: dict[str | None, set[tuple[int, ...]]] = {}
    for r in tr.requests:
        groups.setdefault(r.session_id, set()).add(r.hash_ids[:prefix_blocks])
    assert len(groups) == 3 and all(len(v) == 1 for v in groups.values())
    assert len({next(iter(v)) for v in groups.values()}) == 3
