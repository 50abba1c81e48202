"""One live-bench row from the runs of one (workload, router) over several seeds (bench/live.py).

Why pool: a p99 over one 300-request replay is its third-worst request, and the same code gave
ratios to the best peer 0.2-0.4 apart from one run to the next (docs/performance.md, "Is there
placement headroom on Mooncake?"). Each seed draws other sessions of a generated workload, or
another window of a trace file (``live_workloads.load``), so the replays are independent samples
of the same kind of traffic; their
first tokens are pooled before any quantile is taken (a p99 over 900 requests is the ninth-worst),
never averaged as quantiles. Sums pool as sums (prefix-cache hits and queries, the engines' TTFT
histograms, the cached-token audit's outcomes and causes), rates as a ratio of sums. The TTFT
audit's median absolute error is a median per replica already (kvgate's /metrics); seeds combine
it weighted by their first tokens, as ``kvgate_audit`` combines replicas. Each seed's own
figures stay in the row under ``per_seed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench import live_metrics
from bench.live_hop import Stages


@dataclass
class RunMeasure:
    """What one replay of one seed measured (raw, before any quantile)."""

    seed: int
    policy: str  # the policy the router ran (vllm-router falls back to cache_aware)
    statuses: list[int]
    ttft_ms: list[float]  # the requests answered 200 with a first token
    wall_s: float
    hits: float
    queries: float
    engine_queries: list[float]  # each engine's, in fleet order
    engine_ttft: dict[float, float]  # cumulative buckets, the run's delta summed over the fleet
    audit: dict[str, Any] = field(default_factory=dict)  # kvgate only (live_metrics.kvgate_audit)
    # per request an engine logged (bench/live_hop.py): client send -> engine handler, the
    # engine's parse (its tokenizer thread's queue and work), the engine to its first token, and
    # that token's way back to the client
    stages: Stages = field(default_factory=Stages)
    # CPU seconds during the replay: the router's process tree, and kvgate's agents (0 for a
    # router with none: the peers read the engines' events in their own process)
    router_cpu_s: float = 0.0
    agents_cpu_s: float = 0.0


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1e3, 3) if seconds is not None else None


def _quantiles(ms: Sequence[float]) -> tuple[float, float]:
    arr = np.array(ms) if ms else np.zeros(1)
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def _audit(runs: Sequence[RunMeasure]) -> dict[str, Any]:
    with_audit = [r.audit for r in runs if r.audit]
    if not with_audit:
        return {}
    firsts = sum(a["ttft_audit_first_tokens"] for a in with_audit)
    errs = [(a["ttft_audit_median_abs_error"], a["ttft_audit_first_tokens"]) for a in with_audit]
    weighted = [(e, n) for e, n in errs if e is not None]
    audited = sum(a["cached_audit_requests"] for a in with_audit)
    exact = sum(
        a["cached_audit_exact_fraction"] * a["cached_audit_requests"]
        for a in with_audit
        if a["cached_audit_exact_fraction"] is not None
    )
    causes: dict[str, int] = {}
    for a in with_audit:
        for cause, n in a["cached_audit_causes"].items():
            causes[cause] = causes.get(cause, 0) + n
    weight = sum(n for _, n in weighted)
    return {
        "ttft_audit_median_abs_error": sum(e * n for e, n in weighted) / weight if weight else None,
        "ttft_audit_first_tokens": firsts,
        "cached_audit_exact_fraction": exact / audited if audited else None,
        "cached_audit_requests": audited,
        "cached_audit_causes": dict(sorted(causes.items())),
    }


def _hop(runs: Sequence[RunMeasure]) -> dict[str, Any]:
    """The stages of the first token, pooled like the first tokens (None: not logged)."""
    out: dict[str, Any] = {}
    for name in Stages.NAMES:
        ms = [t for r in runs for t in getattr(r.stages, name)]
        q = _quantiles(ms) if ms else None
        out[f"{name}_p50_ms"] = None if q is None else round(q[0], 3)
        out[f"{name}_p99_ms"] = None if q is None else round(q[1], 3)
    # the requests behind the engine-counted hit rate (bench/live_hop.py)
    out["engine_hit_requests"] = sum(r.stages.hit_requests for r in runs)
    return out


def _cpu(runs: Sequence[RunMeasure]) -> dict[str, Any]:
    """CPU milliseconds per request sent, the router's and its agents', pooled as sums."""
    requests = sum(len(r.statuses) for r in runs)
    if not requests:
        return {"router_cpu_ms_per_request": None, "agents_cpu_ms_per_request": None}
    return {
        "router_cpu_ms_per_request": round(sum(r.router_cpu_s for r in runs) * 1e3 / requests, 3),
        "agents_cpu_ms_per_request": round(sum(r.agents_cpu_s for r in runs) * 1e3 / requests, 3),
    }


def _one_seed(r: RunMeasure) -> dict[str, Any]:
    p50, p99 = _quantiles(r.ttft_ms)
    return {
        "seed": r.seed,
        "ttft_p50_ms": round(p50, 3),
        "ttft_p99_ms": round(p99, 3),
        "hit_rate": r.hits / r.queries if r.queries > 0 else 0.0,
        "errors": len(r.statuses) - len(r.ttft_ms),
    }


def pooled_row(runs: Sequence[RunMeasure]) -> dict[str, Any]:
    """The row's measured figures over ``runs`` (one per seed, same workload and router)."""
    assert runs and len({len(r.engine_queries) for r in runs}) == 1, "one fleet shape per row"
    ttft = [t for r in runs for t in r.ttft_ms]
    p50, p99 = _quantiles(ttft)
    engine: dict[float, float] = {}
    for r in runs:
        for le, v in r.engine_ttft.items():
            engine[le] = engine.get(le, 0.0) + v
    hits, queries = sum(r.hits for r in runs), sum(r.queries for r in runs)
    wall = sum(r.wall_s for r in runs)
    requests = sum(len(r.statuses) for r in runs)
    each = [sum(col) for col in zip(*(r.engine_queries for r in runs), strict=True)]
    return {
        "policy": "/".join(sorted({r.policy for r in runs})),
        "seeds": [r.seed for r in runs],
        "requests": requests,
        "ok": len(ttft),
        "errors": requests - len(ttft),
        "wall_s": wall,
        "throughput_rps": len(ttft) / wall if wall else 0.0,
        "ttft_p50_ms": p50,
        "ttft_p99_ms": p99,
        "engine_ttft_p50_ms": _ms(live_metrics.quantile(engine, 0.5)),
        "engine_ttft_p99_ms": _ms(live_metrics.quantile(engine, 0.99)),
        **_hop(runs),
        **_cpu(runs),
        "hit_rate": hits / queries if queries > 0 else 0.0,
        "queried_tokens": queries,
        # the share of the prompt tokens each engine was sent (engine order: hetero's slow ones odd)
        "engine_token_share": [round(q / queries, 3) if queries > 0 else 0.0 for q in each],
        **_audit(runs),
        "per_seed": [_one_seed(r) for r in runs],
    }


def pooled_floor(floors: Sequence[Sequence[float]]) -> dict[str, Any]:
    """The TTFT floor over the seeds' floor runs (each request's floor in ms, bench/live_floor.py):
    pooled like the routed runs' first tokens, so that it bounds their pooled quantiles."""
    p50, p99 = _quantiles([t for f in floors for t in f])
    return {"floor_ttft_p50_ms": round(p50, 3), "floor_ttft_p99_ms": round(p99, 3)}
