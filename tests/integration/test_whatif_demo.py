"""``make whatif-demo`` at a small size: a live sim-engine fleet records its traffic, the what-if
replays the recording in the simulator, and the figures the issue asks for hold: the simulated
hit rate of the unchanged fleet within 5 points of the engines' counted one, the gateway's
eviction-miss share within 5 points of the engines', savings equal to the engines' cached tokens
times the prices; ``kvgate report`` renders the live report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvgate_tools import whatif_demo


@pytest.mark.timeout(300)
def test_whatif_demo_loop(tmp_path: Path) -> None:
    args = argparse.Namespace(
        replicas=3, cache_blocks=320, sessions=20, think_s=2.0, profile="llama3-8b-h100",
        time_scale=1.0, seed=1, out=tmp_path,
    )  # fmt: skip
    assert whatif_demo.run(args) == 0
    doc = json.loads((tmp_path / "whatif.json").read_text())
    assert doc["errors"] == 0 and doc["recorded_lines"] == doc["requests"]
    assert 0 < doc["live_hit_rate"] < 1
    assert abs(doc["whatif_same_fleet_hit_rate"] - doc["live_hit_rate"]) <= 0.05
    assert doc["eviction_miss_share"] is not None and doc["eviction_miss_share"] > 0
    assert abs(doc["eviction_miss_share"] - doc["eviction_miss_share_engine"]) <= 0.05
    assert doc["savings_usd"] == pytest.approx(doc["expected_savings_usd"], rel=1e-9)
    assert [r["scenario"] for r in doc["rows"]] == [
        "current fleet",
        "2x-replicas",
        "2x-cache",
        "policy=least_loaded",
    ]
    assert doc["rows"][2]["hit_rate"] >= doc["rows"][0]["hit_rate"]
    report = (tmp_path / "whatif-report.txt").read_text()
    assert "TOTAL" in report and "tenant-" in report and "Cache lifetime" in report
    assert (tmp_path / "whatif.png").stat().st_size > 0
