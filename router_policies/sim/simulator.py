"""Discrete-event simulation of a gateway routing a trace over N replica models.

Per arrival, exactly what the gateway does, with the very same objects:
  1. ``RequestFeatures``: block keys of the request's full blocks, computed with
     ``router_policies.block_keys.chain_keys`` from the root of the model namespace, treating
     each block id as the block's whole content (one "token" per block: ``chain_keys(root, ids,
     1)``). Trace ids are prefix identities, so equal keys <=> equal ids.
  2. The gateway's decision path, run by ``SimGateway`` (``sim_gateway.py``) with the gateway's
     own placement code (``router_policies.placement``): ``PrefixIndex.match(keys)``, a
     ``FleetSnapshot`` (the gateway's own flights: in-flight requests and tokens and pending
     prefill, the prompt minus its predicted cached tokens until the first token; the engine's
     running / waiting / kv usage, the replica model's metrics reported without lag; the
     matches), ``policy.choose`` and ``policy.commit`` (a policy from
     ``router_policies.registry.build_policy``), the speculative index entry with the lifetime
     the gateway gives a replica with an agent (``proxy.speculative_ttl_s``, 10 s) and the
     sweep of expired entries each virtual second.
  3. The request is submitted to the chosen replica model.
The index learns precisely from each replica model's BlockStored / BlockRemoved /
AllBlocksCleared events, applied when the step that produced them ends (what the agent reports).

Event order at equal times: arrivals first, then replica steps (so a request arriving when a
step ends joins the next one). Replica steps use the model's fast-forward with the next arrival as
horizon. Everything is seeded and iteration orders are fixed, so a run is deterministic.

Results per run: hit rate (cached prompt tokens at admission / prompt tokens, over every request),
TTFT p50 / p99 (first token time - arrival, including queueing), throughput (requests / time from
the first arrival to the last completion), and load imbalance (most requests routed to one replica /
mean per replica).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from router_policies.block_keys import chain_keys, root_key
from router_policies.placement import Flight, TtftFeed
from router_policies.policy import RequestFeatures
from router_policies.prefix_index import IndexConfig, PrefixIndex
from router_policies.registry import build_policy
from router_policies.sim.replica_model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineConfig,
    EngineRequest,
    ReplicaModel,
    StepResult,
)
from router_policies.sim.sim_gateway import SimGateway
from router_policies.sim.traces import Trace
from router_policies.ttft.params import TtftParams, params_from_step_costs

SIM_MODEL = "sim-model"
_START = 0
_END = 1


@dataclass(frozen=True, slots=True)
class PreparedTrace:
    """Per-request arrays computed once per trace and shared by every run."""

    block_size: int
    arrival_s: np.ndarray  # original arrival times, seconds
    prompt: list[int]
    output: list[int]  # >= 1
    ids: list[tuple[int, ...]]  # full-block ids
    keys: list[list[int]]  # their chained block keys
    # the same as uint64 arrays: PrefixIndex converts keys with block_table.as_keys, which passes a
    # uint64 array through without a copy
    key_arrays: list[np.ndarray]
    key_of: Mapping[int, int]  # block id -> key
    session: list[str | None]


def prepare(trace: Trace, model: str = SIM_MODEL) -> PreparedTrace:
    root = root_key(model)
    bs = trace.block_size
    key_of: dict[int, int] = {}
    ids_l: list[tuple[int, ...]] = []
    keys_l: list[list[int]] = []
    for r in trace.requests:
        ids = tuple(r.hash_ids[: r.input_length // bs])
        # ids are arbitrary ints; fold them to 32 bits per half so any int64 id is accepted
        arr = np.asarray([(i & 0xFFFFFFFFFFFFFFFF) for i in ids], dtype=np.uint64)
        halves = np.empty(2 * len(ids), dtype=np.uint64)
        halves[0::2] = arr & 0xFFFFFFFF
        halves[1::2] = arr >> np.uint64(32)
        keys = chain_keys(root, halves, 2) if ids else []
        for i, k in zip(ids, keys, strict=True):
            key_of.setdefault(i, k)
        ids_l.append(ids)
        keys_l.append(keys)
    return PreparedTrace(
        block_size=bs,
        arrival_s=np.asarray([r.timestamp_ms / 1000.0 for r in trace.requests], dtype=np.float64),
        prompt=[r.input_length for r in trace.requests],
        output=[max(1, r.output_length) for r in trace.requests],
        ids=ids_l,
        keys=keys_l,
        key_arrays=[np.asarray(k, dtype=np.uint64) for k in keys_l],
        key_of=key_of,
        session=[r.session_id for r in trace.requests],
    )


@dataclass(frozen=True, slots=True)
class RunResult:
    policy: str
    load: float
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    throughput_rps: float
    max_over_mean_load: float
    requests: int
    preemptions: int
    sim_end_s: float
    ttft_audit_median_abs_error: float = float("nan")  # the TTFT model's, over every first token

    def as_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "load": self.load,
            "hit_rate": round(self.hit_rate, 6),
            "ttft_p50_ms": round(self.ttft_p50_ms, 3),
            "ttft_p99_ms": round(self.ttft_p99_ms, 3),
            "throughput_rps": round(self.throughput_rps, 6),
            "max_over_mean_load": round(self.max_over_mean_load, 6),
        }


ProgressFn = Callable[[int, int], None]
PolicySpec = tuple[str, Mapping[str, Any] | None]  # a registered policy's name and its parameters
# one engine for every replica, or one per replica (a heterogeneous fleet: profiles.fleet_profiles)
Engines = EngineConfig | Sequence[EngineConfig]


@dataclass(frozen=True, slots=True)
class SimFleet:
    """The simulated fleet every run of a matrix shares: ``replicas`` replica models of
    ``engine``, the index's bounds, and the seed each run's policy is built with."""

    replicas: int
    engine: Engines
    seed: int = 0
    index_config: IndexConfig | None = None


def fleet_engines(engine: Engines, replicas: int) -> list[EngineConfig]:
    """Replica i's engine."""
    if isinstance(engine, EngineConfig):
        return [engine] * replicas
    engines = list(engine)
    if len(engines) != replicas:
        raise ValueError(f"{len(engines)} engines for {replicas} replicas")
    return engines


def engine_ttft_prior(engine: EngineConfig) -> TtftParams:
    """The TTFT model of a replica running ``engine`` (its step costs and settings)."""
    return params_from_step_costs(
        engine.costs,
        engine.max_num_batched_tokens,
        engine.max_num_seqs,
        engine.num_blocks * engine.block_size,
    )


def simulate(
    prep: PreparedTrace,
    fleet: SimFleet,
    policy_spec: PolicySpec,
    load: float,
    arrival_s: np.ndarray,
    progress: ProgressFn | None = None,
) -> RunResult:
    """One run of the trace (with arrival times ``arrival_s``) through the policy ``policy_spec``."""
    policy, policy_params = policy_spec
    replicas = fleet.replicas
    names = [f"r{i}" for i in range(replicas)]
    engines = fleet_engines(fleet.engine, replicas)
    models = [ReplicaModel(e) for e in engines]
    index = PrefixIndex(fleet.index_config or IndexConfig())
    ttft_errors: list[float] = []  # the TTFT audit: |relative error| of each first token
    feed = TtftFeed(listener=lambda sample: ttft_errors.append(abs(sample.relative_error)))
    for name, e in zip(names, engines, strict=True):  # the replica's engine: its cold-start TTFT model
        feed.model.set_prior(name, engine_ttft_prior(e))
    gw = SimGateway(
        names,
        build_policy(policy, policy_params, seed=fleet.seed),
        index,
        lambda ri: models[ri].load(),
        ttft=feed,
    )
    bs = prep.block_size
    key_of = prep.key_of
    n = len(prep.prompt)
    arrivals = arrival_s.tolist()
    first_at = [0.0] * n
    cached_tok = [0] * n
    flights: list[Flight | None] = [None] * n
    routed_to = [0] * n
    done_at = [0.0] * n
    preemptions = 0
    # heap of (time, seq, replica, kind): kind _START begins a step of an idle replica, kind _END
    # delivers the results of its running step. scheduled[ri]: that replica has an entry queued.
    heap: list[tuple[float, int, int, int]] = []
    scheduled = [False] * replicas
    pending: list[StepResult | None] = [None] * replicas
    seq = 0
    inf = float("inf")

    def start_step(ri: int, t: float, horizon: float) -> None:
        nonlocal seq
        res = models[ri].step(t, horizon)
        pending[ri] = res
        heapq.heappush(heap, (res.end, seq, ri, _END))
        seq += 1

    def apply(ri: int, res: StepResult) -> None:
        nonlocal preemptions
        name = names[ri]
        for ev in res.events:
            if isinstance(ev, BlockStored):
                gw.stored(name, [key_of[b] for b in ev.block_ids], res.end)
            elif isinstance(ev, BlockRemoved):
                gw.removed(name, [key_of[b] for b in ev.block_ids], res.end)
            elif isinstance(ev, AllBlocksCleared):
                gw.cleared(name, res.end)
        for ft in res.first_tokens:
            rid = ft.request_id
            assert isinstance(rid, int)
            first_at[rid] = res.end
            cached_tok[rid] = ft.cached_tokens
            flight = flights[rid]
            assert flight is not None
            flight.first_byte(res.end)
        for rid in res.finished:
            assert isinstance(rid, int)
            done_at[rid] = res.end
            flight = flights[rid]
            assert flight is not None
            flight.end(res.end)  # a stream read to its end: its pace is measured
            flights[rid] = None
        preemptions += len(res.preempted)

    i = 0
    report_every = max(1, n // 100)
    while i < n or heap:
        next_arr = arrivals[i] if i < n else inf
        if heap and heap[0][0] < next_arr:
            # every arrival up to and including this instant is in: steps may begin
            t, _s, ri, kind = heapq.heappop(heap)
            if kind == _END:
                res = pending[ri]
                assert res is not None
                pending[ri] = None
                apply(ri, res)
            nt = models[ri].next_step_time()
            if nt is None:
                scheduled[ri] = False
            else:
                start_step(ri, max(nt, t), next_arr)
            continue
        # an arrival
        t = next_arr
        prompt = prep.prompt[i]
        feats = RequestFeatures(
            model=SIM_MODEL,
            block_keys=prep.keys[i],
            prompt_tokens=prompt,
            block_size=bs,
            session_id=prep.session[i],
        )
        routed = gw.route(feats, prep.output[i], t, cast(Sequence[int], prep.key_arrays[i]))
        ri = routed.replica
        flights[i] = routed.flight
        routed_to[i] = ri
        models[ri].submit(EngineRequest(i, prep.ids[i], prompt, prep.output[i]), t)
        if not scheduled[ri]:
            # idle replica: it starts a step at t, after every other arrival at t (heap order)
            scheduled[ri] = True
            heapq.heappush(heap, (t, seq, ri, _START))
            seq += 1
        i += 1
        if progress is not None and (i % report_every == 0 or i == n):
            progress(i, n)
    ttft = np.asarray(first_at) - arrival_s
    total_prompt = sum(prep.prompt)
    counts = np.bincount(np.asarray(routed_to), minlength=replicas)
    end = max(done_at) if n else 0.0
    span = end - float(arrival_s[0]) if n else 0.0
    return RunResult(
        policy=policy,
        load=load,
        hit_rate=sum(cached_tok) / total_prompt if total_prompt else 0.0,
        ttft_p50_ms=float(np.percentile(ttft, 50)) * 1000.0,
        ttft_p99_ms=float(np.percentile(ttft, 99)) * 1000.0,
        throughput_rps=n / span if span > 0 else 0.0,
        max_over_mean_load=float(counts.max() / counts.mean()) if n else 0.0,
        requests=n,
        preemptions=preemptions,
        sim_end_s=end,
        ttft_audit_median_abs_error=float(np.median(ttft_errors)) if ttft_errors else float("nan"),
    )


def oracle_hit_rate(prep: PreparedTrace, capacity_blocks: int) -> float:
    """Hit rate of one shared LRU cache of ``capacity_blocks`` blocks serving every request in
    arrival order: a request hits its longest cached leading run (capped like the engine, so at
    least one prompt token is computed), then touches all its full blocks tail first, so that a
    prefix outlives its tails (vLLM's free order). No concurrency, no pinning: a reference for
    what routing over caches of the same total size keeps, not a bound (one LRU is not optimal:
    prompts cycling through a cache just too small for them all miss every time, where separate
    caches can keep some of them)."""
    from collections import OrderedDict

    lru: OrderedDict[int, None] = OrderedDict()
    bs = prep.block_size
    hit = 0
    for ids, prompt in zip(prep.ids, prep.prompt, strict=True):
        cap = min(len(ids), (prompt - 1) // bs)
        run = 0
        while run < cap and ids[run] in lru:
            run += 1
        hit += run * bs
        for b in reversed(ids):
            if b in lru:
                lru.move_to_end(b)
            else:
                lru[b] = None
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    total = sum(prep.prompt)
    return hit / total if total else 0.0


def no_cache_service_s(prep: PreparedTrace, engine: EngineConfig) -> float:
    """Mean engine time one request costs a saturated replica without any cache hit.

    Per request with prompt P and output N: the prefill (linear plus causal-attention terms),
    N - 1 decode tokens each reading a KV of about P + N / 2 tokens, and its share of the fixed
    step overhead: (N - 1 + ceil(P / token budget)) steps shared by the batch that fits, which is
    min(max_num_seqs, KV blocks / mean blocks per request)."""
    c = engine.costs
    p = np.asarray(prep.prompt, dtype=np.float64)
    o = np.asarray(prep.output, dtype=np.float64)
    bs = engine.block_size
    blocks = np.ceil((p + o) / bs)
    batch = max(1.0, min(float(engine.max_num_seqs), engine.num_blocks / float(blocks.mean())))
    prefill = c.prefill_s_per_token * p + c.prefill_s_per_token_ctx * p * (p + 1) / 2
    decode = (o - 1) * (c.decode_s_per_seq + c.decode_s_per_ctx_token * (p + o / 2))
    steps = (o - 1) + np.ceil(p / engine.max_num_batched_tokens)
    overhead = c.step_overhead_s * steps / batch
    return float((prefill + decode + overhead).mean())


def scaled_arrivals(prep: PreparedTrace, load: float, replicas: int, engine: Engines) -> np.ndarray:
    """Arrival times rescaled so that the offered rate is ``load`` x the fleet's no-cache capacity
    (replicas / ``no_cache_service_s``): t' = t0 + (t - t0) x natural_rate / target_rate. The order
    and relative spacing of arrivals are kept."""
    t = prep.arrival_s
    n = len(t)
    if n < 2 or t[-1] <= t[0]:
        return t.copy()
    natural = (n - 1) / float(t[-1] - t[0])
    # the fleet's capacity: the sum of its replicas' (replicas / service time when identical)
    target = load * sum(1.0 / no_cache_service_s(prep, e) for e in fleet_engines(engine, replicas))
    return np.asarray(t[0] + (t - t[0]) * (natural / target), dtype=np.float64)


def _bind(progress: Callable[[str, float, int, int], None], name: str, load: float) -> ProgressFn:
    def cb(done: int, total: int) -> None:
        progress(name, load, done, total)

    return cb


def run_matrix(
    prep: PreparedTrace,
    fleet: SimFleet,
    policies: Sequence[PolicySpec],
    loads: Sequence[float],
    progress: Callable[[str, float, int, int], None] | None = None,
) -> list[RunResult]:
    """Every policy at every load (loads outer, policies inner), on the same fleet."""
    out = []
    for load in loads:
        arr = scaled_arrivals(prep, load, fleet.replicas, fleet.engine)
        for spec in policies:
            cb = None if progress is None else _bind(progress, spec[0], load)
            out.append(simulate(prep, fleet, spec, load, arr, cb))
    return out
