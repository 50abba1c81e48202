"""The live bench's pooling of several seeds into one row (``bench/live_pool.py``): quantiles of
the pooled first tokens (not averaged quantiles), rates as ratios of sums; and each seed's window
of a trace file (``bench/live_workloads.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.live_pool import RunMeasure, pooled_row
from bench.live_workloads import trace_window
from router_policies.sim.traces import Trace, TraceRequest


def _run(
    seed: int, ttft: list[float], hits: float, queries: float, audit: dict[str, Any] | None = None
) -> RunMeasure:
    return RunMeasure(
        seed=seed,
        policy="kv_aware",
        statuses=[200] * len(ttft) + [0],  # one request failed in every run
        ttft_ms=ttft,
        wall_s=10.0,
        hits=hits,
        queries=queries,
        engine_queries=[queries / 4, 3 * queries / 4],
        engine_ttft={0.01: 1.0, 0.1: float(len(ttft)), float("inf"): float(len(ttft))},
        audit=audit or {},
    )


def test_quantiles_are_taken_over_every_seeds_first_tokens() -> None:
    quiet = list(np.linspace(1.0, 10.0, 100))
    burst = [*np.linspace(1.0, 10.0, 95), 500.0, 600.0, 700.0, 800.0, 900.0]
    row = pooled_row([_run(5, quiet, 10, 100), _run(6, burst, 30, 100)])
    pooled = np.percentile([*quiet, *burst], 99)
    assert row["ttft_p99_ms"] == float(pooled)
    # averaging each seed's p99 would give another figure: the pool is not that
    each = [s["ttft_p99_ms"] for s in row["per_seed"]]
    assert abs(row["ttft_p99_ms"] - sum(each) / 2) > 1.0
    assert [s["seed"] for s in row["per_seed"]] == [5, 6] and row["seeds"] == [5, 6]
    assert row["requests"] == 202 and row["ok"] == 200 and row["errors"] == 2
    assert row["throughput_rps"] == 200 / 20.0


def test_rates_are_ratios_of_sums_and_histograms_add() -> None:
    row = pooled_row([_run(5, [1.0] * 10, 10, 100), _run(6, [2.0] * 30, 90, 300)])
    assert row["hit_rate"] == 100 / 400  # not the mean of 0.1 and 0.3
    assert row["queried_tokens"] == 400
    assert row["engine_token_share"] == [0.25, 0.75]
    assert row["engine_ttft_p50_ms"] is not None and 10.0 < row["engine_ttft_p50_ms"] <= 100.0


def test_cpu_per_request_pools_as_sums_over_every_request_sent() -> None:
    a, b = _run(5, [1.0] * 9, 10, 100), _run(6, [2.0] * 29, 90, 300)  # 10 and 30 requests sent
    a.router_cpu_s, a.agents_cpu_s, b.router_cpu_s, b.agents_cpu_s = 0.5, 0.1, 0.3, 0.3
    row = pooled_row([a, b])
    # not the mean of each seed's 50 and 10 ms
    assert row["router_cpu_ms_per_request"] == 800 / 40 and row["agents_cpu_ms_per_request"] == 400 / 40
    assert pooled_row([_run(5, [], 0, 0)])["router_cpu_ms_per_request"] == 0.0


def test_audits_pool_by_their_counts() -> None:
    def audit(err: float, firsts: int, exact: float, causes: dict[str, int]) -> dict[str, Any]:
        return {
            "ttft_audit_median_abs_error": err,
            "ttft_audit_first_tokens": firsts,
            "cached_audit_exact_fraction": exact,
            "cached_audit_requests": firsts,
            "cached_audit_causes": causes,
        }

    a = _run(5, [1.0], 1, 2, audit(0.1, 100, 1.0, {}))
    b = _run(6, [1.0], 1, 2, audit(0.4, 300, 0.9, {"evicted": 20, "stale": 10}))
    row = pooled_row([a, b])
    assert abs(row["ttft_audit_median_abs_error"] - (0.1 * 100 + 0.4 * 300) / 400) < 1e-12
    assert row["ttft_audit_first_tokens"] == 400
    assert abs(row["cached_audit_exact_fraction"] - (100 + 270) / 400) < 1e-12
    assert row["cached_audit_causes"] == {"evicted": 20, "stale": 10}
    assert "ttft_audit_median_abs_error" not in pooled_row([_run(5, [1.0], 1, 2)])  # a peer: no audit


def test_a_trace_file_gives_each_seed_its_own_window_from_time_zero() -> None:
    reqs = tuple(TraceRequest(1000.0 + 10.0 * i, 512, 1, (i,)) for i in range(10))
    trace = Trace("t", 512, reqs)
    w1, w2 = trace_window(trace, 3, seed=1), trace_window(trace, 3, seed=5)  # 3 windows of 3
    assert [r.hash_ids for r in w1.requests] == [(3,), (4,), (5,)]
    assert [r.hash_ids for r in w2.requests] == [(6,), (7,), (8,)]  # 5 mod 3 = window 2
    assert [r.timestamp_ms for r in w1.requests] == [0.0, 10.0, 20.0]
    assert trace_window(trace, 6, seed=1) is trace  # fewer than two windows: the whole trace
