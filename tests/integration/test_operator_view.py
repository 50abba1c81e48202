"""The operator view on a real fleet (sim-engines publishing ZMQ KV events, agents over gRPC, the
gateway), driven by the seeded agent workload over HTTP: ``/admin/report`` savings equal the
engines' own counted cached tokens times the configured prices, the recorded trace is read by
``kvgate compare --trace`` unchanged, and the cache-lifetime figures come from engine events."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvgate_tools.demo import engine_hit_counters
from kvgate_tools.demo_workload import AgentWorkloadSpec, agent_sessions
from kvgate_tools.local_fleet import FleetOptions, LocalFleet, http_json, http_text
from kvgate_tools.operator_replay import replay_sessions
from router_policies.sim.traces import load_trace

PRICE_IN, PRICE_CACHED = 3.0, 0.3  # USD per million prompt tokens, the test's own figures


def _fleet(tmp_path: Path, cache_blocks: int) -> LocalFleet:
    operator = {
        "trace": {"enabled": True, "path": str(tmp_path / "rec" / "trace.jsonl"), "reorder_window_s": 0.2},
        "prices": {"kvgate-tiny": {"input": PRICE_IN, "cached_input": PRICE_CACHED}},
        "gpus_per_replica": 2,
    }
    opts = FleetOptions(
        replicas=2,
        cache_blocks=cache_blocks,
        time_scale=0.2,
        extra_config={"operator": operator},
        log_dir=tmp_path / "logs",
    )
    return LocalFleet(opts)


def _engine_hits(fleet: LocalFleet) -> tuple[float, float]:
    hits = queries = 0.0
    for i in range(len(fleet.engines)):
        h, q = engine_hit_counters(fleet.engine_metrics(i))
        hits, queries = hits + h, queries + q
    return hits, queries


def _status(url: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _report(fleet: LocalFleet) -> Any:
    return http_json(f"{fleet.gateway_url}/admin/report", headers=fleet.admin_headers)


@pytest.mark.timeout(240)
def test_report_savings_equal_engine_counted_cached_tokens_times_prices(tmp_path: Path) -> None:
    spec = AgentWorkloadSpec(sessions=14, turns=(2, 4), session_rate_per_s=6.0, think_time_mean_s=0.3)
    sessions = agent_sessions("kvgate-tiny", spec)
    with _fleet(tmp_path, cache_blocks=4096) as fleet:
        result = asyncio.run(replay_sessions(fleet.gateway_url, sessions))
        assert result.errors == 0
        report = _report(fleet)
        hits, queries = _engine_hits(fleet)
        stopped = http_json(
            f"{fleet.gateway_url}/admin/trace", {"enabled": False}, headers=fleet.admin_headers
        )
        table = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "report", "--url", fleet.gateway_url],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "KVGATE_ADMIN_TOKEN": fleet.opts.admin_token},
        )
        whatif_json = tmp_path / "whatif.json"
        whatif = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "whatif",
                "--trace",
                str(tmp_path / "rec" / "trace.jsonl"),
                "--gateway",
                fleet.gateway_url,
                "--cache-blocks",
                "4096",
                "--time-scale",
                "0.2",
                "--json",
                str(whatif_json),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "KVGATE_ADMIN_TOKEN": fleet.opts.admin_token},
        )
        bad = _status(f"{fleet.gateway_url}/admin/trace", b'{"enabled": "yes"}', fleet.admin_headers)
        unauthorized = _status(f"{fleet.gateway_url}/admin/report", None, {})
    assert table.returncode == 0, table.stderr
    assert whatif.returncode == 0, whatif.stderr
    rows = json.loads(whatif_json.read_text())["rows"]
    assert rows[0]["replicas"] == 2 and [r["replicas"] for r in rows] == [2, 4, 2]
    live_rate = hits / queries
    assert abs(rows[0]["hit_rate"] - live_rate) <= 0.05, (rows[0], live_rate)
    assert "TOTAL" in table.stdout and "tenant-" in table.stdout and "Prefill speed" in table.stdout
    assert bad[0] == 400 and bad[1]["error"]["param"] == "enabled"
    assert unauthorized[0] == 401 and "error" in unauthorized[1]
    totals = report["savings"]["totals"]
    assert totals["requests"] == result.requests
    assert hits > 0
    assert totals["saved_prefill_tokens"] == hits
    assert totals["prompt_tokens"] == queries
    assert totals["saved_usd"] == pytest.approx(hits * (PRICE_IN - PRICE_CACHED) / 1e6, rel=1e-9)
    assert totals["cost_usd"] == pytest.approx(
        ((queries - hits) * PRICE_IN + hits * PRICE_CACHED) / 1e6, rel=1e-9
    )
    tenants = {r["tenant"] for r in report["savings"]["rows"]}
    assert tenants <= {f"tenant-{t}" for t in range(spec.tenants)} and len(tenants) > 1
    speeds = report["savings"]["prefill_s_per_token"]
    assert set(speeds) == {"r0", "r1"}
    timed = [v for v in speeds.values() if v is not None]
    assert timed and all(v > 0 for v in timed)
    assert totals["saved_gpu_s"] == pytest.approx(2 * totals["saved_engine_s"])

    # the recording: every answered request, in arrival order, read by the simulator unchanged
    assert not stopped["enabled"] and stopped["lines"] == result.requests, (
        stopped["skipped"],
        stopped["late"],
    )
    path = tmp_path / "rec" / "trace.jsonl"
    trace = load_trace(path)
    assert len(trace.requests) == result.requests and trace.block_size == 16
    assert len({r.session_id for r in trace.requests}) == len(sessions)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert {ln["tenant"] for ln in lines} == tenants
    assert "messages" not in path.read_text() and "agent" not in path.read_text()
    out = tmp_path / "compare.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "compare",
            "--trace",
            str(path),
            "--replicas",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())


@pytest.mark.timeout(240)
def test_cache_lifetime_from_engine_events_and_eviction_misses(tmp_path: Path) -> None:
    """A small cache and long gaps between turns: blocks are evicted, returning turns miss, and the
    gateway's judgement (prefix evicted at arrival) agrees with the engines' cached tokens."""
    spec = AgentWorkloadSpec(
        tenants=6, sessions=24, turns=(2, 3), session_rate_per_s=8.0, think_time_mean_s=2.0
    )
    sessions = agent_sessions("kvgate-tiny", spec)
    with _fleet(tmp_path, cache_blocks=400) as fleet:
        result = asyncio.run(replay_sessions(fleet.gateway_url, sessions))
        assert result.errors == 0
        report = _report(fleet)
        metrics = fleet_metrics(fleet)
    lifetime = report["cache_lifetime"]
    assert sum(r["residency"]["count"] for r in lifetime["replicas"].values()) > 0
    assert lifetime["by_depth"]
    turns = report["turns"]["all"]
    assert turns["returning_turns"] == result.requests - len(sessions)
    assert turns["prefix_evicted"] > 0 and turns["prefix_alive"] > 0
    judged = turns["prefix_alive"] + turns["prefix_evicted"]
    assert judged >= 0.9 * turns["returning_turns"]
    assert abs(turns["eviction_miss_share"] - turns["engine_miss_share"]) <= 0.05
    assert "kvgate_cache_block_residency_seconds_bucket" in metrics
    assert 'prefix="evicted"' in metrics


def fleet_metrics(fleet: LocalFleet) -> str:
    return http_text(f"{fleet.gateway_url}/metrics")
