"""The status page in a real headless Chromium (Debian's, installed by kvgate_tools/chromium.py when
missing; none is a failure, never a skip), against a live sim-engine fleet: the fleet table, the
savings, cache lifetime and recent decisions render with the live figures, and a wrong token shows
the gateway's error instead of figures. ``KVGATE_STATUS_SCREENSHOT=PATH`` also writes a screenshot
(docs/status-page.png is made that way)."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from kvgate_tools.chromium import dump_dom, screenshot
from kvgate_tools.demo_workload import AgentWorkloadSpec, agent_sessions
from kvgate_tools.local_fleet import FleetOptions, LocalFleet, http_json, http_text
from kvgate_tools.operator_replay import replay_sessions


def _cells(dom: str, table_id: str) -> list[list[str]]:
    m = re.search(rf'<table id="{table_id}">(.*?)</table>', dom, re.S)
    assert m, f"no table {table_id}"
    rows = re.findall(r"<tr>(.*?)</tr>", m.group(1), re.S)
    return [[re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<t[dh]>(.*?)</t[dh]>", r, re.S)] for r in rows]


@pytest.mark.timeout(300)
def test_status_page_renders_live_figures_in_headless_chromium(tmp_path: Path) -> None:
    operator = {"prices": {"kvgate-tiny": {"input": 0.27, "cached_input": 0.07}}}
    opts = FleetOptions(replicas=2, cache_blocks=400, time_scale=0.3, extra_config={"operator": operator},
                        log_dir=tmp_path / "logs")  # fmt: skip
    spec = AgentWorkloadSpec(sessions=10, turns=(2, 3), session_rate_per_s=8.0, think_time_mean_s=0.5)
    with LocalFleet(opts) as fleet:
        result = asyncio.run(replay_sessions(fleet.gateway_url, agent_sessions(opts.model, spec)))
        assert result.errors == 0
        report = http_json(f"{fleet.gateway_url}/admin/report", headers=fleet.admin_headers)
        assert "<title>kvgate status</title>" in http_text(f"{fleet.gateway_url}/status")
        url = f"{fleet.gateway_url}/status#token={opts.admin_token}"
        dom = dump_dom(url)
        denied = dump_dom(f"{fleet.gateway_url}/status#token=wrong")
        shot = os.environ.get("KVGATE_STATUS_SCREENSHOT")
        png = screenshot(url, Path(shot) if shot else tmp_path / "status.png")
    assert 'data-ready="1"' in dom, dom[-2000:]
    fleet_rows = _cells(dom, "fleet")
    assert [r[0] for r in fleet_rows[1:]] == ["r0", "r1"]
    assert all(r[1] == "healthy" and r[2] == "connected" for r in fleet_rows[1:])
    hit = report["savings"]["by_replica"]
    for r in fleet_rows[1:]:
        assert r[6] == f"{100 * hit[r[0]]['hit_rate']:.1f} %"
    savings = _cells(dom, "savings")
    assert {r[0] for r in savings[1:]} == {row["tenant"] for row in report["savings"]["rows"]}
    assert "USD saved" in dom and "$" in dom
    decisions = _cells(dom, "decisions")
    assert len(decisions) == 1 + min(20, result.requests)
    assert all(d[3] in ("r0", "r1") and d[4] for d in decisions[1:])
    turns = _cells(dom, "turns")
    assert turns[-1][0] == "all" and int(turns[-1][1]) == report["turns"]["all"]["returning_turns"]
    assert "<rect" in dom  # the residency / turn-gap chart
    assert 'data-ready="error"' in denied and "401" in denied
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
