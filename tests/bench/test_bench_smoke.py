"""Smoke run of every benchmark at tiny sizes (kvgate only: the peer routers' virtualenv is
``make bench``'s business). Asserts on the shape of the outputs, never on timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import index_bench, ingest, live, overhead, report
from bench.live_requests import read_requests


def _number(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(float(x))


def test_benchmarks_run_and_report_every_headline(tmp_path: Path) -> None:
    index_args = ["--blocks", "20000", "--replicas", "2", "8", "--churn-events", "4000", "--match-reps", "3"]
    assert index_bench.main([*index_args, "--out", str(tmp_path / "index.json")]) == 0
    overhead_args = [
        "--requests",
        "40",
        "--sizes",
        "8192",
        "--concurrency",
        "32",
        "--backends",
        "2",
        "--warm-concurrency",
        "32",
        "--no-peers",
    ]
    assert overhead.main([*overhead_args, "--out", str(tmp_path / "overhead.json")]) == 0
    live_args = ["--requests", "8", "--workloads", "agent", "--routers", "kvgate_kv_aware", "--replicas", "2"]
    assert live.main([*live_args, "--seed", "5", "--speedup", "8", "--out", str(tmp_path / "live.json")]) == 0
    assert report.main(["--results", str(tmp_path)]) == 0

    index = json.loads((tmp_path / "index.json").read_text())
    assert [(r["blocks"], r["replicas"]) for r in index["rows"]] == [(20000, 2), (20000, 8)]
    for r in index["rows"]:
        assert r["entries"] >= r["blocks"] and r["distinct_keys"] > 0
        assert set(r["match_us_median"]) == {"128", "2048", "8192"}
        assert all(_number(v) and v > 0 for v in r["match_us_median"].values())
        assert r["churn_events"] > 0 and r["churn_events_per_s"] > 0

    ov = json.loads((tmp_path / "overhead.json").read_text())
    assert [(r["warm"], r["stream"], r["prompt_bytes"], r["concurrency"]) for r in ov["rows"]] == [
        (False, False, 8192, 32),
        (False, True, 8192, 32),
        (True, False, 8192, 32),
    ]
    for row in ov["rows"]:
        for name in ("direct", "kvgate"):
            assert row[name]["requests"] == 40 and row[name]["errors"] == 0
        assert row["kvgate"]["cpu_s"] > 0 and _number(row["kvgate"]["added_p99_ms"])

    lv = json.loads((tmp_path / "live.json").read_text())
    (lrow,) = lv["rows"]
    assert lrow["router"] == "kvgate_kv_aware" and lrow["requests"] == 8 and lrow["errors"] == 0
    assert 0.0 <= lrow["hit_rate"] <= 1.0 and lrow["queried_tokens"] > 0
    # the stages of each first token and the router's CPU, measured for every row
    for key in ("inbound_p50_ms", "engine_parse_p50_ms", "engine_first_token_p50_ms", "outbound_p50_ms"):
        assert _number(lrow[key]) and lrow[key] >= 0, key
    # /proc counts CPU in clock ticks (10 ms): a replay of 8 requests may show none for the agents
    assert lrow["router_cpu_ms_per_request"] > 0 and lrow["agents_cpu_ms_per_request"] >= 0
    # each request's record in the run's folder, in the replay's order (bench.live_requests)
    recs = read_requests(tmp_path / "tmp" / "live" / "agent-kvgate_kv_aware-5")
    assert [r["i"] for r in recs] == list(range(8)) and all(r["engine"] in (0, 1) for r in recs)
    # every request was answered (errors 0), so each engine noted its cached tokens (0 or more)
    assert all(isinstance(r["cached"], int) and r["cached"] >= 0 for r in recs)
    assert sum(1 for r in recs if r["cached"]) == lrow["engine_hit_requests"]

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert tuple(summary) == report.SUMMARY_KEYS
    for key in (
        "overhead_p50_ms",
        "overhead_p99_ms",
        "events_per_s_per_core",
        "match_2048_us_at_10m",
        "bytes_per_block",
        "cpu_ms_per_request",
    ):
        assert _number(summary[key]), key
    # no peer routers in the smoke run: the ratios to them are absent, not invented
    for key in (
        "rps_per_core_vs_sglang_cache_aware",
        "live_ttft_p99_vs_best_peer",
        "live_hit_rate_vs_best_peer",
        "cpu_per_request_vs_sglang_cache_aware",
        "unloaded_added_p99_ms",  # no concurrency-1 point in the smoke run
    ):
        assert summary[key] is None, key
    assert "| kvgate |" in (tmp_path / "table.md").read_text().replace("| json | 8 KB | 32 ", "| ")
    assert (tmp_path / "index_match.png").stat().st_size > 0 and (tmp_path / "live.png").stat().st_size > 0


def test_the_ingest_benchmark_runs_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    assert ingest.main(["--batches", "200", "--repeat", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    stages = [ln[:16].strip() for ln in lines[2:]]  # the stage's column
    assert stages == [
        "decode", "decode+rekey", "agent total", "gateway apply", "gateway apply x8", "index apply",
        "agent+index",
    ]  # fmt: skip
