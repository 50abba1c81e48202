"""The replica model: cache semantics, events, scheduling, fast-forward, calibration."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

import pytest

from router_policies.sim.profiles import PROFILES
from router_policies.sim.replica_model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineConfig,
    EngineRequest,
    KvEvent,
    ReplicaModel,
    RequestTooLargeError,
    StepCosts,
    StepResult,
)

COSTS = StepCosts(step_overhead_s=0.01, prefill_s_per_token=0.001, decode_s_per_seq=0.0005)


def cfg(num_blocks: int = 16, block_size: int = 4, **kw: int) -> EngineConfig:
    return EngineConfig(num_blocks=num_blocks, block_size=block_size, costs=COSTS, **kw)


def req(rid: Hashable, ids: list[int], prompt: int, out: int) -> EngineRequest:
    return EngineRequest(request_id=rid, block_ids=ids, prompt_tokens=prompt, output_tokens=out)


def run(model: ReplicaModel, horizon: float | None = None) -> list[StepResult]:
    out = []
    while (t := model.next_step_time()) is not None:
        out.append(model.step(t, horizon))
    return out


def replay(events: list[KvEvent], cached: set[int]) -> None:
    for ev in events:
        if isinstance(ev, BlockStored):
            if ev.parent is not None:
                assert ev.parent in cached, "a stored block's parent must be cached"
            cached.update(ev.block_ids)
        elif isinstance(ev, BlockRemoved):
            for b in ev.block_ids:
                assert b in cached
                cached.discard(b)
        else:
            cached.clear()


def test_prefix_hit_counts_full_blocks_and_leaves_one_token() -> None:
    m = ReplicaModel(cfg())
    m.submit(req("a", [1, 2, 3], 14, 2), 0.0)
    res = run(m)
    assert res[0].first_tokens[0].cached_tokens == 0
    assert res[0].events == [BlockStored((1, 2, 3), None)]
    m.submit(req("b", [1, 2, 3], 14, 1), 10.0)
    (r,) = run(m)
    assert r.first_tokens[0].cached_tokens == 12
    assert r.finished == ["b"]
    # a prompt made of whole cached blocks still computes its last block (vLLM leaves >= 1 token)
    m.submit(req("c", [1, 2, 3], 12, 1), 20.0)
    (r,) = run(m)
    assert r.first_tokens[0].cached_tokens == 8
    met = m.metrics()
    assert (met.prefix_cache_queries, met.prefix_cache_hits) == (14 + 14 + 12, 0 + 12 + 8)


def test_eviction_is_least_recently_freed_and_tail_first() -> None:
    # 6 blocks of 4 tokens; each request uses 2 blocks (1 cached + 1 partial/decode)
    m = ReplicaModel(cfg(num_blocks=6))
    m.submit(req("a", [10, 11], 8, 1), 0.0)  # blocks: 2 full, no partial
    run(m)
    m.submit(req("b", [20, 21], 8, 1), 1.0)
    run(m)
    assert m.cached_ids() == {10, 11, 20, 21}
    # free queue now: 2 never-used blocks, then a's tail 11, head 10, then b's 21, 20
    m.submit(req("c", [30, 31, 32], 12, 1), 2.0)  # needs 3 new blocks: 2 plain + a's tail 11
    (r,) = run(m)
    assert r.events[0] == BlockRemoved((11,))
    assert m.cached_ids() == {10, 20, 21, 30, 31, 32}
    m.submit(req("d", [20, 40], 9, 1), 3.0)  # hit 20, needs 2 new blocks: evicts 10, then 21
    (r,) = run(m)
    assert r.first_tokens[0].cached_tokens == 4
    assert r.events[0] == BlockRemoved((10, 21))


def test_blocks_of_running_requests_are_pinned() -> None:
    m = ReplicaModel(cfg(num_blocks=6))
    m.submit(req("long", [1, 2], 8, 12), 0.0)
    t = m.next_step_time()
    assert t is not None
    m.step(t)  # long is running, holding blocks 1, 2
    m.submit(req("x", [5, 6, 7], 15, 1), t)
    # x needs 4 blocks (3 full + the decode block), only 3 are free: it waits (FCFS) without evicting pinned blocks
    t = m.next_step_time()
    assert t is not None
    r = m.step(t)
    assert not r.first_tokens and m.metrics().waiting == 1
    assert {1, 2} <= m.cached_ids()
    results = run(m)
    finished = [f for res in results for f in res.finished]
    assert finished == ["long", "x"]


def test_preemption_recomputes_and_still_finishes() -> None:
    # two requests whose decodes outgrow the cache: the later one is preempted, then finishes
    m = ReplicaModel(cfg(num_blocks=6, block_size=4))
    m.submit(req("a", [1], 4, 12), 0.0)
    m.submit(req("b", [2], 4, 12), 0.0)
    results = run(m)
    assert any(res.preempted == ["b"] for res in results)
    finished = [f for res in results for f in res.finished]
    assert finished == ["a", "b"]
    tokens: dict[Hashable, int] = {}
    for res in results:
        for ft in res.first_tokens:
            tokens[ft.request_id] = tokens.get(ft.request_id, 0) + 1
        for rid, n in res.decoded:
            tokens[rid] = tokens.get(rid, 0) + n
    assert tokens == {"a": 12, "b": 12}
    # as vLLM's prefix-cache counters: b's re-admission (which finds its own prefill cached) is not
    # a second lookup; each request is counted once, at its first admission (nothing cached then)
    assert (m.metrics().prefix_cache_queries, m.metrics().prefix_cache_hits) == (8, 0)


def random_workload(
    seed: int, n: int, block_size: int, rate: float = 4.0
) -> list[tuple[float, EngineRequest]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1 << 40) for _ in range(12)] for _ in range(5)]
    out = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        base = rng.choice(prefixes)
        k = rng.randrange(0, 8)
        prompt_blocks = base[:k] + [rng.randrange(1 << 40) for _ in range(rng.randrange(0, 5))]
        prompt = len(prompt_blocks) * block_size + rng.randrange(0, block_size)
        if prompt == 0:
            prompt = 1
        out.append((t, req(i, prompt_blocks, prompt, rng.randrange(1, 40))))
    return out


def drive(
    model: ReplicaModel,
    work: list[tuple[float, EngineRequest]],
    fast: bool,
    on_result: Callable[[StepResult], None] | None = None,
) -> list[StepResult]:
    """Feed arrivals and steps in time order (arrivals first on ties), as the simulator does."""
    results = []
    i = 0
    while i < len(work) or model.next_step_time() is not None:
        t = model.next_step_time()
        if i < len(work) and (t is None or work[i][0] <= t):
            model.submit(work[i][1], work[i][0])
            i += 1
            continue
        assert t is not None
        horizon = (work[i][0] if i < len(work) else float("inf")) if fast else None
        results.append(model.step(t, horizon))
        if on_result is not None:
            on_result(results[-1])
    return results


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_replaying_events_reproduces_the_cached_set(seed: int) -> None:
    m = ReplicaModel(cfg(num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=24))
    cached: set[int] = set()
    checked = 0

    def check(res: StepResult) -> None:
        nonlocal checked
        replay(res.events, cached)
        assert cached == m.cached_ids()
        checked += bool(res.events)

    results = drive(m, random_workload(seed, 300, 4), fast=False, on_result=check)
    assert checked > 50
    assert any(isinstance(e, BlockRemoved) for r in results for e in r.events)
    assert m.metrics().kv_usage == 0.0
    assert m.clear()
    t = 1e9
    m.submit(req("z", [], 3, 1), t)
    (res,) = run(m)
    assert res.events[0] == AllBlocksCleared()
    replay(res.events, cached)
    assert cached == m.cached_ids() == set()


def summary(results: list[StepResult]) -> tuple[dict[Hashable, float], dict[Hashable, float], list[KvEvent]]:
    first = {ft.request_id: r.end for r in results for ft in r.first_tokens}
    done = {rid: r.end for r in results for rid in r.finished}
    events = [e for r in results for e in r.events]
    return first, done, events


@pytest.mark.parametrize("profile", ["small-cpu", "llama3-8b-h100"])
def test_fast_forward_equals_step_by_step(profile: str) -> None:
    p = PROFILES[profile]
    config = p.engine_config(block_size=16, num_blocks=60)
    # an arrival every ~20 step overheads of either profile, so that decode runs exist between them
    work = random_workload(7, 200, 16, rate=0.05 / p.costs.step_overhead_s)
    slow = drive(ReplicaModel(config), work, fast=False)
    fast = drive(ReplicaModel(config), work, fast=True)
    assert len(fast) < len(slow) / 2, "fast-forward should merge most decode steps"
    f1, d1, e1 = summary(slow)
    f2, d2, e2 = summary(fast)
    assert e1 == e2
    assert f1.keys() == f2.keys() and d1.keys() == d2.keys()
    for k in f1:
        assert f2[k] == pytest.approx(f1[k], rel=1e-9, abs=1e-9)
    for k in d1:
        assert d2[k] == pytest.approx(d1[k], rel=1e-9, abs=1e-9)


def test_small_cpu_profile_reproduces_the_seed_figures() -> None:
    p = PROFILES["small-cpu"]
    m = ReplicaModel(p.engine_config(block_size=32))
    ids = list(range(2000 // 32))
    m.submit(req("miss", ids, 2000, 1), 0.0)
    (r,) = run(m)
    assert r.end - r.start == pytest.approx(2.100, abs=0.005)
    m.submit(req("hit", ids, 2000, 1), 100.0)
    (r,) = run(m)
    assert r.first_tokens[0].cached_tokens == 1984
    assert r.end - r.start == pytest.approx(0.190, abs=0.005)


def test_clear_is_refused_while_blocks_are_pinned() -> None:
    m = ReplicaModel(cfg())
    m.submit(req("a", [1], 4, 5), 0.0)
    m.step(0.0)
    assert not m.clear()
    run(m)
    assert m.clear()
    assert m.cached_ids() == set()


def test_bad_requests_are_refused() -> None:
    m = ReplicaModel(cfg(num_blocks=4))
    with pytest.raises(RequestTooLargeError):
        m.submit(req("big", [1, 2, 3, 4], 16, 10), 0.0)
    with pytest.raises(ValueError, match="block ids"):
        m.submit(req("bad", [1], 9, 1), 0.0)
    with pytest.raises(ValueError):
        m.step(0.0)


def test_gpu_profiles_and_heterogeneous_fleets() -> None:
    from router_policies.errors import UserInputError
    from router_policies.sim.profiles import fleet_profiles

    h100, a100 = PROFILES["llama3-8b-h100"], PROFILES["llama3-8b-a100"]
    # a 2,000-token miss on an idle engine: one step of overhead + prefill (+ attention)
    ratio = a100.costs.prefill_s_per_token / h100.costs.prefill_s_per_token
    assert ratio == pytest.approx(989 / 312)
    mixed = fleet_profiles("h100+a100", 4)
    assert [p.name for p in mixed] == ["llama3-8b-h100", "llama3-8b-a100"] * 2
    assert fleet_profiles("llama3-8b-h100*1,llama3-8b-a100*2", 3)[1:] == [a100, a100]
    assert fleet_profiles("small-cpu", 2) == [PROFILES["small-cpu"]] * 2
    with pytest.raises(UserInputError, match="lists 2 replicas, not 3"):
        fleet_profiles("llama3-8b-h100*2", 3)
    with pytest.raises(UserInputError, match="unknown profile"):
        fleet_profiles("nope*3", 3)
    # the TTFT prior of a profile predicts what its engine does for a lone request
    from router_policies.ttft.features import TtftInputs, predict

    for prof in (h100, a100):
        m = ReplicaModel(prof.engine_config(16))
        m.submit(req("x", list(range(125)), 2000, 1), 0.0)
        (res,) = run(m)
        pred = predict(prof.ttft_prior(), TtftInputs(0, 0, 0, 2000, 0))
        assert pred.total_ms == pytest.approx(res.end * 1000, rel=1e-6)


def test_decode_heavy_workload_is_mostly_decode() -> None:
    from router_policies.sim.simulator import no_cache_service_s, prepare
    from router_policies.sim.workloads import generate

    trace = generate("decode-heavy", 0)
    assert trace.name == "decode-heavy"
    outs = sorted(r.output_length for r in trace.requests)
    assert 1000 <= outs[len(outs) // 2] <= 1400
    engine = PROFILES["llama3-8b-h100"].engine_config(trace.block_size)
    prep = prepare(trace)
    c = engine.costs
    prefill = sum(
        c.prefill_s_per_token * p + c.prefill_s_per_token_ctx * p * (p + 1) / 2 for p in prep.prompt
    )
    assert prefill / len(prep.prompt) < 0.4 * no_cache_service_s(prep, engine)


def test_a_request_admitted_in_the_step_of_a_prefix_last_chunk_hits_the_whole_prefix() -> None:
    """vLLM v1 caches the blocks of the tokens it schedules (``KVCacheManager.allocate_slots``
    calls ``cache_blocks`` up to the computed plus the newly scheduled tokens), and schedules
    running requests before waiting ones: a request admitted in the step that computes the last
    chunk of a shared prefix finds the whole prefix cached, that chunk included."""
    m = ReplicaModel(cfg(num_blocks=32, block_size=4, max_num_batched_tokens=12))
    m.submit(req("a", [1, 2, 3, 4, 5], 20, 1), 0.0)
    first = m.step(0.0)  # "a" computes 12 of its 20 tokens: blocks 1-3
    assert first.events == [BlockStored((1, 2, 3), None)]
    m.submit(req("b", [1, 2, 3, 4, 5], 21, 1), first.end)
    second = m.step(first.end)  # "a"'s last 8 tokens, then "b" in the 4 tokens left
    assert second.events == [BlockStored((4, 5), 3)]
    # blocks 4 and 5 were scheduled in the step "b" joined: it computes its 21st token only
    assert {ft.request_id: ft.cached_tokens for ft in second.first_tokens} == {"a": 0, "b": 20}
