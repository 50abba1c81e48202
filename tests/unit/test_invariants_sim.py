"""The invariants and formulas stated in the simulator (router_policies/sim: replica_model,
kv_blocks, engine_types, simulator, workloads, profiles, whatif, compare_cli), each checked over
seeded random sequences (the house rule: an invariant a comment states holds because a test or an
assert says so). A claim found false is kept as ``xfail(strict=True)`` with the reason."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from router_policies.sim import whatif
from router_policies.sim.compare_cli import parse_policies
from router_policies.sim.engine_types import ReqState
from router_policies.sim.kv_blocks import BlockPool
from router_policies.sim.profiles import PROFILES
from router_policies.sim.replica_model import (
    BlockStored,
    EngineConfig,
    KvEvent,
    ReplicaModel,
    StepCosts,
    StepResult,
)
from router_policies.sim.simulator import (
    RunResult,
    SimFleet,
    fleet_engines,
    no_cache_service_s,
    oracle_hit_rate,
    prepare,
    run_matrix,
    scaled_arrivals,
    simulate,
)
from router_policies.sim.traces import Trace, TraceRequest
from router_policies.sim.workloads import (
    AgentSpec,
    GroupsSpec,
    LogNormal,
    _Prompt,
    _Renumber,
    agent_sessions,
    agent_trace,
    group_requests,
)
from tests.sim.test_replica_model import cfg, drive, random_workload, req, run
from tests.sim.test_traces import small_agent
from tests.unit.test_invariants_placement import test_the_glue_is_synchronous_and_reads_no_clock as _sync

REPO = Path(__file__).resolve().parents[2]
ALL_COSTS = StepCosts(0.01, 0.001, 1e-6, 0.0005, 1e-5)  # every term of the step cost at work


# ---------------------------------------------------------------------- kv_blocks.py, replica_model.py
def _check_engine(m: ReplicaModel, res: StepResult, horizon: bool, decoding: set[Hashable]) -> set[Hashable]:
    """The engine's state after ``res`` (``decoding``: the requests decoding before it); returns
    the requests decoding after it."""
    pool, c = m._pool, m.config
    # one free queue of exactly the unreferenced blocks; a block's references are the running
    # requests holding it (a waiting request holds none); cached ids and blocks are inverse maps
    holders = Counter(p for r in m._running for p in r.phys)
    assert all(not r.phys for r in m._waiting)
    assert [pool._ref[p] for p in range(c.num_blocks)] == [holders[p] for p in range(c.num_blocks)]
    assert set(pool._free) == {p for p in range(c.num_blocks) if pool._ref[p] == 0}
    assert {b: p for p, b in enumerate(pool._hash) if b is not None} == pool._cached
    # ReqState: kv_cap = len(phys) x block_size; computed within target; stored within the ids
    for r in [*m._running, *m._waiting]:
        assert r.kv_cap == len(r.phys) * c.block_size and 0 <= r.computed <= r.target and r.stored <= r.n_ids
    # a step's tokens within the budget, its sequences within max_num_seqs; preempted requests go
    # back to the front of the waiting queue (in admission order); without a horizon one step
    decodes = sum(rid in decoding for rid, _ in res.decoded)
    assert res.prefill_tokens + decodes <= c.max_num_batched_tokens and len(m._running) <= c.max_num_seqs
    assert [r.rid for r in m._waiting][: len(res.preempted)] == res.preempted[::-1]
    assert horizon or res.steps == 1
    # the next step no earlier than this one's end, at it while requests run
    nt = m.next_step_time()
    assert nt is None or nt >= res.end
    assert not m._running or nt == res.end
    return {r.rid for r in m._running if r.computed == r.target}


@pytest.mark.parametrize(
    ("seed", "fast", "blocks", "seqs"), [(1, False, 40, 6), (2, False, 100, 3), (3, True, 40, 6)]
)
def test_the_block_pool_and_the_scheduler_keep_their_invariants(
    seed: int, fast: bool, blocks: int, seqs: int
) -> None:
    """kv_blocks.py and replica_model.py ("KV cache", "Scheduling"): the pool's free queue, references
    and cached ids stay consistent; a stored run is consecutive blocks after its parent; FCFS (first
    tokens in submission order, preemptions included); each request emits exactly its output
    tokens and finishes once."""
    m = ReplicaModel(cfg(num_blocks=blocks, block_size=4, max_num_seqs=seqs, max_num_batched_tokens=24))
    work = random_workload(seed, 300, 4)
    parent = {ids[i]: (ids[i - 1] if i else None) for _, r in work for ids in [list(r.block_ids)] for i in range(len(ids))}  # fmt: skip
    order = {r.request_id: i for i, (_, r) in enumerate(work)}
    firsts: list[Hashable] = []
    tokens: dict[Hashable, int] = {}
    finished: list[Hashable] = []
    seen = {"preempted": 0, "most_running": 0}
    decoding: set[Hashable] = set()

    def check(res: StepResult) -> None:
        nonlocal decoding
        decoding = _check_engine(m, res, fast, decoding)
        for ev in res.events:
            if isinstance(ev, BlockStored):
                assert [parent[b] for b in ev.block_ids] == [ev.parent, *ev.block_ids[:-1]]
        firsts.extend(ft.request_id for ft in res.first_tokens)
        for rid, n in [(ft.request_id, 1) for ft in res.first_tokens] + res.decoded:
            tokens[rid] = tokens.get(rid, 0) + n
        finished.extend(res.finished)
        seen["preempted"] += len(res.preempted)
        seen["most_running"] = max(seen["most_running"], len(m._running))

    drive(m, work, fast=fast, on_result=check)
    assert seen["preempted"] > 0 if blocks == 40 else seen["most_running"] == seqs  # the limits bind
    assert firsts == sorted(firsts, key=order.__getitem__)
    assert sorted(finished, key=order.__getitem__) == [r.request_id for _, r in work]
    assert tokens == {r.request_id: r.output_tokens for _, r in work}


def test_a_refused_allocation_or_admission_changes_nothing() -> None:
    """kv_blocks.py: ``allocate`` returns False with nothing changed when fewer than k blocks are
    free; ``admit`` returns -1 leaving everything unchanged."""
    pool, events = BlockPool(8, 4), list[KvEvent]()
    first = ReqState(req("a", [1, 2], 9, 1))
    assert pool.admit(first, events) == 0
    pool.store_scheduled(first, 9, events)
    pool.release(first)
    busy = ReqState(req("b", [7], 6, 1))
    assert pool.admit(busy, events) == 0  # holds 2 blocks: 6 free, 2 of them cached
    big = ReqState(req("c", [1, 2, 3, 4, 5, 6], 25, 1))  # hits 1, 2; needs 5 more of the 4 left
    before = (copy.deepcopy(vars(pool)), [getattr(big, s) for s in ReqState.__slots__], list(events))
    assert pool.admit(big, events) == -1
    out: list[int] = []
    assert not pool.allocate(7, events, out) and not out
    assert (vars(pool), [getattr(big, s) for s in ReqState.__slots__], events) == before


def test_a_lone_request_costs_the_documented_step_formula() -> None:
    """replica_model.py, "Step cost": overhead + prefill x sum n_i + ctx x sum (n_i c_i + n_i (n_i +
    1) / 2) + decode x #decoding + decode_ctx x sum L_j, L_j the KV length after the step; chunked
    prefill (budget 16); fast-forward's closed form ends where the steps one by one do."""
    c, prompt, out = ALL_COSTS, 30, 9
    chunks = [(16, 0), (14, 16)]  # (n_i, c_i)
    want = sum(c.step_overhead_s + c.prefill_s_per_token * n + c.prefill_s_per_token_ctx * (n * ci + n * (n + 1) / 2) for n, ci in chunks)  # fmt: skip
    want += sum(c.step_overhead_s + c.decode_s_per_seq + c.decode_s_per_ctx_token * (prompt + j) for j in range(1, out))  # fmt: skip
    for horizon in (None, math.inf):
        m = ReplicaModel(EngineConfig(64, 4, c, max_num_batched_tokens=16))
        m.submit(req("x", list(range(7)), prompt, out), 0.0)
        results = run(m, horizon)
        assert results[-1].end == pytest.approx(want, rel=1e-12)
        assert results[-1].finished == ["x"]


def test_abort_releases_a_request_like_a_finish() -> None:
    """replica_model.py: ``abort`` drops a waiting or running request, its blocks released as a
    finished one's (cached ones stay cached, no event); False for a request not in the engine."""
    m = ReplicaModel(cfg(num_blocks=16, block_size=4))
    m.submit(req("a", [1, 2], 9, 20), 0.0)
    m.step(0.0)
    m.submit(req("b", [5], 4, 1), 0.0)
    assert m.abort("a") and m.abort("b") and not m.abort("a") and not m.abort("zzz")
    assert m.next_step_time() is None and m.metrics().kv_usage == 0.0 and m.cached_ids() == {1, 2}
    m.submit(req("c", [1, 2], 9, 1), 1.0)
    (res,) = run(m)
    assert res.events == [] and res.first_tokens[0].cached_tokens == 8


# ---------------------------------------------------------------------- simulator.py
def test_prepared_keys_are_the_ids_one_to_one_and_outputs_at_least_one() -> None:
    """simulator.py: each block id's key is the chained key of its prefix (equal keys <=> equal
    ids), any int64 id accepted; traces.py: an output of 0 is simulated as one token."""
    odd = (-1, 2**63 - 1, -(2**63))
    hand = [TraceRequest(0.0, 3 * 16, 0, odd), TraceRequest(1.0, 2 * 16 + 3, 4, (-1, 7, 99)), TraceRequest(2.0, 17, 1, (2**48 - 1,))]  # fmt: skip
    for trace in (agent_trace(small_agent(), 5), Trace("odd", 16, tuple(hand))):
        prep = prepare(trace)
        for ids, keys, r in zip(prep.ids, prep.keys, trace.requests, strict=True):
            assert len(keys) == r.input_length // trace.block_size and keys == [prep.key_of[i] for i in ids]
        assert len(set(prep.key_of.values())) == len(prep.key_of)
        assert prep.output == [max(1, r.output_length) for r in trace.requests]


def _tiny(n: int = 24) -> Trace:
    reqs = [TraceRequest(500.0 + 250.0 * i, 100 + 37 * (i % 5), 1 + i % 7, tuple(range(1000 * (i % 3), 1000 * (i % 3) + (100 + 37 * (i % 5)) // 16))) for i in range(n)]  # fmt: skip
    return Trace("tiny", 16, tuple(reqs))


def test_no_cache_service_time_and_scaled_arrivals_follow_their_formulas() -> None:
    """simulator.py: the service time is the mean of prefill + (N - 1) decodes reading P + N / 2 +
    overhead x (N - 1 + ceil(P / budget)) / min(max_num_seqs, blocks / mean blocks); the arrivals
    are t0 + (t - t0) x natural / target, target = load x the fleet's capacity (sum of 1 /
    service), order and relative spacing kept."""
    prep = prepare(_tiny())
    h100, a100 = (PROFILES[n].engine_config(16, 400) for n in ("llama3-8b-h100", "llama3-8b-a100"))
    for e in (h100, a100):
        c, blocks = e.costs, [math.ceil((p + o) / 16) for p, o in zip(prep.prompt, prep.output, strict=True)]
        batch = max(1.0, min(e.max_num_seqs, e.num_blocks / (sum(blocks) / len(blocks))))
        per = [c.prefill_s_per_token * p + c.prefill_s_per_token_ctx * p * (p + 1) / 2
               + (o - 1) * (c.decode_s_per_seq + c.decode_s_per_ctx_token * (p + o / 2))
               + c.step_overhead_s * (o - 1 + math.ceil(p / e.max_num_batched_tokens)) / batch
               for p, o in zip(prep.prompt, prep.output, strict=True)]  # fmt: skip
        assert no_cache_service_s(prep, e) == pytest.approx(sum(per) / len(per), rel=1e-12)
    t = prep.arrival_s
    for load, engines in ((0.5, h100), (1.3, [h100, a100, a100])):
        arr = scaled_arrivals(prep, load, 3, engines)
        capacity = sum(1 / no_cache_service_s(prep, e) for e in fleet_engines(engines, 3))
        assert (len(arr) - 1) / (arr[-1] - arr[0]) == pytest.approx(load * capacity, rel=1e-9)
        assert arr[0] == t[0] and np.all(np.diff(arr) >= 0)
        np.testing.assert_allclose(np.diff(arr) * (t[-1] - t[0]), np.diff(t) * (arr[-1] - arr[0]), rtol=1e-9)


def test_runs_go_loads_outer_and_arrivals_come_before_steps_at_equal_times() -> None:
    """simulator.py: ``run_matrix`` runs loads outer, policies inner; throughput is requests / (last
    completion - first arrival); an arrival at the instant a step ends joins the next step."""
    prep, engine = prepare(_tiny()), PROFILES["llama3-8b-h100"].engine_config(16, 400)
    policies = [("round_robin", None), ("least_loaded", None)]
    runs = run_matrix(prep, SimFleet(2, engine), policies, [0.5, 1.0])
    assert [(r.load, r.policy) for r in runs] == [(ld, p) for ld in (0.5, 1.0) for p, _ in policies]
    for r in runs:
        assert r.throughput_rps == pytest.approx(r.requests / (r.sim_end_s - prep.arrival_s[0]))
    # every step takes 1 s: request 1 arrives as request 0's prefill step ends and joins the next step
    one_second = EngineConfig(64, 16, StepCosts(1.0, 0.0))
    two = prepare(Trace("t", 16, (TraceRequest(0.0, 40, 3, (1, 2)), TraceRequest(1000.0, 40, 1, (3, 4)))))
    res = simulate(two, SimFleet(1, one_second), ("round_robin", None), 1.0, two.arrival_s)
    assert (res.ttft_p50_ms, res.ttft_p99_ms) == (1000.0, 1000.0)


def test_the_oracle_hit_rate_is_no_bound_on_routing() -> None:
    """simulator.oracle_hit_rate is a reference, not a bound (found false as "an upper bound"):
    prompts cycling through one LRU just too small for them all miss every time, where
    consistent_hash over two caches of half its size keeps some."""
    reqs = [TraceRequest(10_000.0 * (c * 6 + k), 8 * 16 + 1, 1, tuple(1000 * k + j for j in range(8))) for c in range(5) for k in range(6)]  # fmt: skip
    prep = prepare(Trace("cycle", 16, tuple(reqs)))
    engine = EngineConfig(17, 16, StepCosts(0.01, 0.0001))
    res = simulate(prep, SimFleet(2, engine), ("consistent_hash", None), 1.0, prep.arrival_s)
    assert oracle_hit_rate(prep, 2 * engine.num_blocks) == 0.0 < res.hit_rate


# ---------------------------------------------------------------------- workloads.py
def test_generated_ids_name_their_prefix_and_draws_stay_in_their_bounds() -> None:
    """workloads.py: equal prefixes get equal ids and nothing else does (an id stands for one
    chain of ids before it), ids are dense from 0; the same (spec, seed) gives the same trace;
    a ``LogNormal`` draw is clamped to its bounds (inclusive); turns are at most ``max_turns``."""
    agent, groups = agent_trace(small_agent(), 5), group_requests(GroupsSpec(3, 5, 640), 1)
    for trace in (agent, groups):
        prefix: dict[int, tuple[int, ...]] = {}
        for r in trace.requests:
            assert len(r.hash_ids) == r.input_length // trace.block_size  # one id per full block
            for i, b in enumerate(r.hash_ids):
                assert prefix.setdefault(b, r.hash_ids[:i]) == r.hash_ids[:i]
        assert set(prefix) == set(range(len(prefix)))
    # a block repeated after another prefix gets a new id; a prompt extended piecewise, the same ids
    renumber, tokens = _Renumber(), np.arange(12, dtype=np.int64)
    twice, pieces = _Prompt(7, 4, renumber), _Prompt(7, 4, renumber)
    for chunk in (tokens[:8], tokens[:8]):
        twice.extend(chunk)
    for chunk in (tokens[:3], tokens[3:]):
        pieces.extend(chunk)
    assert (twice.ids, pieces.ids) == ([0, 1, 2, 3], [0, 1, 4])
    assert agent == agent_trace(small_agent(), 5) and groups == group_requests(GroupsSpec(3, 5, 640), 1)
    rng = random.Random(11)
    for dist in (LogNormal(300.0, 0.6), LogNormal(200.0, 2.0, (8, 2000)), LogNormal(5.0, 3.0, (4, 9))):
        assert all(dist.clamp[0] <= dist.draw(rng) <= dist.clamp[1] for _ in range(500))
    spec = AgentSpec(tenants=2, sessions=60, mean_turns=30.0, max_turns=5)
    assert all(1 <= len(s.turns) <= spec.max_turns for s in agent_sessions(spec, 3))


def test_generated_ids_are_numbered_in_order_of_generation() -> None:
    """workloads.py: ids are renumbered 0, 1, 2, ... as they are generated, session by session
    (found false as "in order of first appearance" in the trace, which a later session's first
    turn can precede): every number up to the highest is used, and the trace does not meet them
    in order."""
    seen: set[int] = set()
    in_order, top = True, -1
    for r in agent_trace(small_agent(), 5).requests:
        for b in r.hash_ids:
            in_order &= b <= top + 1
            top = max(top, b)
            seen.add(b)
    assert seen == set(range(top + 1)) and not in_order


# ---------------------------------------------------------------------- profiles.py, whatif.py, compare_cli.py
def test_the_profiles_are_their_datasheet_figures() -> None:
    """profiles.py: llama3-8b-a100 is 128.7 us per prefill token, 11.3 + 1.2 ms per step, 91.8 ns
    per KV token read, ~3.2x slower to prefill and ~1.5x slower to decode than the H100; a 12k
    prompt spends ~16 % of its H100 prefill in attention; small-cpu: overhead 174.6 ms, 0.963 ms."""
    h, a, cpu = (PROFILES[n].costs for n in ("llama3-8b-h100", "llama3-8b-a100", "small-cpu"))
    assert (a.prefill_s_per_token, a.step_overhead_s, a.decode_s_per_ctx_token) == pytest.approx((128.7e-6, 12.45e-3, 91.8e-9), rel=2e-3)  # fmt: skip
    assert a.prefill_s_per_token / h.prefill_s_per_token == pytest.approx(3.2, abs=0.05)
    assert (a.step_overhead_s + a.decode_s_per_seq) / (h.step_overhead_s + h.decode_s_per_seq) == pytest.approx(1.5, abs=0.1)  # fmt: skip
    attention = h.prefill_s_per_token_ctx * 12_000 * 12_001 / 2
    assert attention / (attention + h.prefill_s_per_token * 12_000) == pytest.approx(0.16, abs=0.01)
    assert (cpu.step_overhead_s, cpu.prefill_s_per_token) == pytest.approx((174.6e-3, 0.963e-3), rel=1e-3)


def test_the_h100_kv_capacity_is_781_blocks_of_512() -> None:
    """profiles.py: the H100's ~400k tokens of KV are 781 blocks of 512 (found false as 782)."""
    assert PROFILES["llama3-8b-h100"].default_blocks(512) == 781


def test_whatif_scales_the_costs_sets_the_prefill_speed_and_replays_the_recorded_times(monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """whatif.py: the profile's step costs x --time-scale, and the prefill cost per token set to
    --prefill-ms-per-1k when given (ms per 1k tokens); every scenario runs at the trace's recorded
    arrival times, not rescaled; compare_cli.py: bracketed values are JSON, else strings."""
    base = PROFILES["llama3-8b-h100"].costs
    for prefill in (None, 250.0):
        got = whatif.engine_of("llama3-8b-h100", 32, 100, 3.0, prefill).costs
        want = [getattr(base, f.name) * 3.0 for f in dataclasses.fields(StepCosts)]
        want[1] = want[1] if prefill is None else prefill / 1e6
        assert [getattr(got, f.name) for f in dataclasses.fields(StepCosts)] == pytest.approx(want, rel=1e-12)
    seen: list[tuple[Any, ...]] = []

    def fake(prep: Any, fleet: SimFleet, spec: Any, load: float, arrival: Any) -> RunResult:
        seen.append(
            (arrival is prep.arrival_s, load, fleet.replicas, fleet_engines(fleet.engine, 1)[0].num_blocks)
        )
        return RunResult(spec[0], load, 0.5, 1.0, 2.0, 3.0, 1.0, 1, 0, 1.0)

    monkeypatch.setattr(whatif, "simulate", fake)
    fleet = whatif.FleetModel(2, whatif.engine_of("small-cpu", 16, 100, 1.0, None), "kv_aware", {})
    whatif.whatif(prepare(_tiny()), fleet, whatif.variations("2x-replicas,3x-cache", fleet), seed=0)
    assert seen == [(True, 1.0, 2, 100), (True, 1.0, 4, 100), (True, 1.0, 2, 300)]
    assert parse_policies("kv_aware[balance_abs=8,rule=ms],round_robin") == [
        ("kv_aware", {"balance_abs": 8, "rule": "ms"}),
        ("round_robin", {}),
    ]


# ---------------------------------------------------------------------- sim/__init__.py
@pytest.mark.parametrize("module", sorted(str(p.relative_to(REPO)) for p in (REPO / "router_policies/sim").glob("*.py") if p.name not in ("compare_cli.py", "sim_gateway.py")))  # fmt: skip
def test_the_simulation_reads_no_clock(module: str) -> None:
    """sim/__init__.py: "time is always passed in by the caller" (compare_cli reads a clock only
    for its progress line on stderr)."""
    _sync(module)


def test_the_simulator_loads_no_aiohttp_grpc_or_asyncio() -> None:
    """sim/__init__.py: "Pure code: no aiohttp, grpc or asyncio", what it imports included (a fresh
    interpreter: pytest itself loads asyncio)."""
    code = (
        "import sys, router_policies.sim.compare_cli, router_policies.sim.whatif, gateway.report_cli;"
        "print(sorted({'aiohttp', 'grpc', 'asyncio'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
