"""Smoke of ``make faults`` (kvgate_tools/faults/, docs/faults.md) at a small size: three of its
scenarios on real processes, written to out/faults.json's schema; and its classifier, which
decides what counts as broken, on answers that must not pass."""

from __future__ import annotations

import json
from pathlib import Path

from kvgate_tools.faults.common import classify_body
from kvgate_tools.faults.http_faults import kind_of_raw
from kvgate_tools.faults.run import main

ROW = {"name", "sent", "ok", "clear_error", "broken", "lost", "reconverge_s", "peak_rss_mb", "pass"}


def test_three_scenarios_pass_and_write_the_table(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    only = ["malformed_http", "abusive_streams", "events_duplicated"]
    assert main(["--out", str(out), "--only", *only]) == 0
    rows = json.loads(out.read_text())["scenarios"]
    assert [r["name"] for r in rows] == ["events_duplicated", "malformed_http", "abusive_inventory_streams"]
    for r in rows:
        assert set(r) >= ROW, r
        assert r["pass"] and r["sent"] > 0 and r["lost"] == 0 and r["broken"] == 0, r
        assert r["sent"] == r["ok"] + r["clear_error"] + r["broken"] + r["lost"], r
        assert r["peak_rss_mb"] > 0, r
    assert rows[0]["reconverge_s"] is not None and rows[0]["reconverge_s"] <= 2.0
    assert rows[1]["sent"] >= 50 and rows[2]["sent"] >= 15


def test_the_classifier_calls_unshaped_answers_broken() -> None:
    err = b'{"error": {"message": "m", "type": "t", "param": null, "code": "c"}}'
    assert classify_body(400, err, stream=False) == "clear_error"
    assert classify_body(500, b"Internal Server Error", stream=False) == "broken"
    assert classify_body(400, b'{"error": "text"}', stream=False) == "broken"
    assert classify_body(200, b'data: {"choices": []}\n\n', stream=True) == "broken"  # cut: no [DONE]
    assert classify_body(200, b"data: " + err + b"\n\ndata: [DONE]\n\n", stream=True) == "clear_error"
    assert kind_of_raw(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\n\r\nBad") == "broken"
    assert kind_of_raw(b"") == "lost"
