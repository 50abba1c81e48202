"""Smoke run of the streaming benchmark at a tiny size (kvgate only): every event of every answer
reaches the client through the gateway, paced by the backends, and the CPU per chunk is measured.
Asserts on the shape and the event counts, never on timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench import streaming


def test_streamed_answers_are_relayed_event_by_event_and_costed(tmp_path: Path) -> None:
    out = tmp_path / "streaming.json"
    args = ["--no-peers", "--chunks", "24", "--gap-ms", "5", "--concurrency", "4", "--rounds", "2"]
    assert streaming.main([*args, "--idle-seconds", "0.3", "--backends", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    for name in ("direct", "kvgate"):
        r = row[name]
        assert r["requests"] == 8 and r["errors"] == 0
        # 24 token events, the usage event and [DONE], each counted once at the client
        assert r["events"] == 8 * 26
        # paced: the median gap between events is the backends' step, not a burst
        assert r["gap_p50_ms"] >= 2.5
    kv = row["kvgate"]
    assert kv["one_chunk"]["requests"] == 8 and kv["one_chunk"]["errors"] == 0
    assert math.isfinite(kv["cpu_us_per_chunk"]) and kv["cpu_us_per_chunk"] > 0
    summary = result["summary"]
    assert summary["cpu_per_chunk_vs_sglang_cache_aware"] is None  # no peers: no ratio invented
    assert summary["routers"]["kvgate"]["4"]["cpu_us_per_chunk"] == round(kv["cpu_us_per_chunk"], 3)
