"""The live bench's readings (bench/live_metrics.py) and its summary figures (bench/report.py)."""

from __future__ import annotations

from typing import Any

import pytest

from bench import live_metrics, report

ENGINE = """# HELP vllm:time_to_first_token_seconds x
vllm:time_to_first_token_seconds_bucket{le="0.01",model_name="sim"} 10.0
vllm:time_to_first_token_seconds_bucket{le="0.02",model_name="sim"} 90.0
vllm:time_to_first_token_seconds_bucket{le="0.05",model_name="sim"} 99.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="sim"} 100.0
vllm:prefix_cache_hits_total{model_name="sim"} 30.0
vllm:prefix_cache_queries_total{model_name="sim"} 100.0
"""


def test_a_histograms_quantile_is_linear_within_its_bucket() -> None:
    b = live_metrics.buckets([ENGINE, ENGINE])  # two engines: summed
    assert b[0.02] == 180.0
    assert live_metrics.quantile(b, 0.5) == pytest.approx(0.01 + 0.01 * (100 - 20) / 160)
    assert live_metrics.quantile(b, 0.99) == pytest.approx(0.05)  # the 198th of 200: within 0.05
    assert live_metrics.quantile(b, 1.0) == 0.05  # in +Inf: the last finite bound
    assert live_metrics.quantile(live_metrics.delta(b, b), 0.5) is None
    assert live_metrics.sums([ENGINE], ["vllm:prefix_cache_hits_total"]) == {
        "vllm:prefix_cache_hits_total": 30.0
    }


def test_kvgates_audits_are_read_from_its_metrics() -> None:
    text = """kvgate_ttft_prediction_median_abs_error{replica="a"} 0.1
kvgate_ttft_prediction_median_abs_error{replica="b"} 0.4
kvgate_ttft_prediction_relative_error_count{replica="a"} 30.0
kvgate_ttft_prediction_relative_error_count{replica="b"} 10.0
kvgate_prediction_audit_total{replica="a",outcome="exact"} 9.0
kvgate_prediction_audit_total{replica="a",outcome="over"} 1.0
kvgate_prediction_audit_inexact_total{replica="a",cause="evicted"} 1.0
"""
    got = live_metrics.kvgate_audit(text)
    assert got["ttft_audit_median_abs_error"] == pytest.approx((0.1 * 30 + 0.4 * 10) / 40)
    assert got["cached_audit_exact_fraction"] == 0.9 and got["cached_audit_causes"] == {"evicted": 1}
    # several workers (kvgate serve --workers 2): each audits its own first tokens of a replica
    workers = """kvgate_ttft_prediction_median_abs_error{replica="a",worker="0"} 0.1
kvgate_ttft_prediction_median_abs_error{replica="a",worker="1"} 0.4
kvgate_ttft_prediction_relative_error_count{replica="a",worker="0"} 30.0
kvgate_ttft_prediction_relative_error_count{replica="a",worker="1"} 10.0
"""
    got = live_metrics.kvgate_audit(workers)
    assert got["ttft_audit_median_abs_error"] == pytest.approx((0.1 * 30 + 0.4 * 10) / 40)
    assert got["ttft_audit_first_tokens"] == 40


def _row(
    wl: str, router: str, p50: float, p99: float, hit: float, audit: float | None = None
) -> dict[str, Any]:
    return {
        "workload": wl,
        "router": router,
        "ok": 10,
        "ttft_p50_ms": p50,
        "ttft_p99_ms": p99,
        "hit_rate": hit,
        "ttft_audit_median_abs_error": audit,
    }


def test_the_live_summary_takes_the_worst_workload_against_the_best_peer() -> None:
    rows = [
        {**_row("a", "kvgate_kv_aware", 10, 80, 0.5, 0.1), "floor_ttft_p99_ms": 40},
        _row("a", "p1", 20, 100, 0.4),
        _row("a", "p2", 12, 200, 0.45),
        {**_row("b", "kvgate_kv_aware", 30, 90, 0.3, 0.25), "floor_ttft_p99_ms": 54},
        _row("b", "p1", 20, 60, 0.6),
    ]
    s = report.summarize(None, None, {"rows": rows}, {"new_replica_share": 0.3})
    assert tuple(s) == report.SUMMARY_KEYS
    assert s["live_ttft_p99_vs_best_peer"] == 1.5 and s["live_ttft_p50_vs_best_peer"] == 1.5
    assert s["live_hit_rate_vs_best_peer"] == 0.5 and s["ttft_audit_median_abs_error"] == 0.25
    assert s["new_replica_share"] == 0.3
    # the floor's p99 over the best peer's: 40 / 100 on a, 54 / 60 on b; the higher is reported
    assert s["live_ttft_p99_floor_vs_best_peer"] == 0.9


def test_the_live_table_shows_the_engines_ttft_both_hops_and_cpu_or_a_dash() -> None:
    base = {"policy": "kv_aware", "throughput_rps": 1.0, "errors": 0, "per_seed": []}
    rows = [
        {**_row("a", "kvgate_kv_aware", 10, 80, 0.5, 0.1), **base, "engine_ttft_p50_ms": 7.25,
         "engine_ttft_p99_ms": 30.0, "inbound_p50_ms": 3.04, "inbound_p99_ms": 12.0,
         "outbound_p50_ms": 0.96, "outbound_p99_ms": 4.0,
         "router_cpu_ms_per_request": 10.934, "agents_cpu_ms_per_request": 6.2},
        {**_row("a", "p1", 20, 100, 0.4), **base},  # a row from before the figures: dashes
        {**_row("a", "p2", 20, 100, 0.4), **base,  # a router with no agents
         "router_cpu_ms_per_request": 2.233, "agents_cpu_ms_per_request": 0.0},
    ]  # fmt: skip
    live = {"rows": rows}
    text = report.table(None, None, live, report.summarize(None, None, live, {"new_replica_share": 0.3}))
    lines = [ln for ln in text.splitlines() if ln.startswith("| a |")]
    assert "| 7.2 / 30.0 | 3.0 / 12.0 | 1.0 / 4.0 | 10.93 (6.20) |" in lines[0]
    assert "| - / - | - / - | - / - | - | - |" in lines[1]
    assert "| - / - | - / - | - / - | 2.23 |" in lines[2]
