"""Each live run's requests, one record a request in the replay's order (``bench/live_hop.py``:
``request_records``), and two runs compared request by request (``bench/live_requests.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.live_hop import REQUESTS_FILE, Logged, Sent, request_records, send_key, write_requests
from bench.live_requests import compare, main, read_requests


def _run(cached: Sequence[int | None], ttft_ms: Sequence[float]) -> list[dict[str, Any]]:
    """A run of len(cached) requests, request i a prompt of its own sent at i s, its first data
    ``ttft_ms[i]`` later, served by engine i % 2 with ``cached[i]`` cached tokens."""
    sends: list[Sent] = []
    arrivals: dict[int, list[Logged]] = {}
    for i, (c, t) in enumerate(zip(cached, ttft_ms, strict=True)):
        key = send_key(f"p{i}")
        sends.append((float(i), key, i + t / 1e3))
        arrivals[key] = [(i + 0.001, i + 0.002, i + t / 1e3 - 0.0005, c, i % 2)]
    return request_records(sends, arrivals)


def test_records_follow_the_sends_order_and_a_send_no_engine_logged_has_none() -> None:
    a, b, c = send_key("a"), send_key("b"), send_key("c")
    # completion order is not request order: the records follow ``sends`` (the replay's order)
    sends: list[Sent] = [(1.0, a, 1.05), (2.0, b, None), (3.0, a, 3.02), (4.0, c, None)]
    arrivals: dict[int, list[Logged]] = {
        a: [(1.002, 1.004, 1.04, 0, 1), (3.001, 3.002, 3.01, 48, 0)],
        b: [(2.01, 2.02, None, None, 2)],
    }
    recs = request_records(sends, arrivals)
    assert [r["i"] for r in recs] == [0, 1, 2, 3] and [r["key"] for r in recs] == [a, b, a, c]
    assert recs[0]["engine"] == 1 and recs[0]["cached"] == 0 and recs[0]["ttft_ms"] == pytest.approx(50.0)
    assert recs[0]["inbound_ms"] == pytest.approx(2.0) and recs[0]["outbound_ms"] == pytest.approx(10.0)
    assert recs[2]["engine"] == 0 and recs[2]["cached"] == 48  # a's second send: its second arrival
    assert recs[1]["ttft_ms"] is None and recs[1]["engine_first_token_ms"] is None
    assert recs[3]["engine"] is None and recs[3]["inbound_ms"] is None  # no engine logged "c"


def test_comparison_names_the_requests_that_differ_and_each_runs_slowest() -> None:
    a = _run([0, 96, 0, None], [10.0, 5.0, 80.0, 20.0])
    b = _run([0, 0, 64, None], [11.0, 30.0, 12.0, 90.0])
    lines = compare(a, b, ("kv", "sg"), slowest=0.25)
    assert lines[0] == "kv: 1 of 4 requests with cached prompt tokens, 96 tokens"
    assert lines[1] == "sg: 1 of 4 requests with cached prompt tokens, 64 tokens"
    assert lines[2] == "cached tokens differ on 2 requests:"
    assert lines[3].startswith("  #1 ") and lines[4].startswith("  #2 ")
    # each run's slowest quarter (one request) beside the same request in the other run
    assert lines[5] == "kv's slowest 1 by client TTFT, beside sg's:" and lines[6].startswith("  #2 ")
    assert "ttft    80.0" in lines[6] and "ttft    12.0" in lines[6]
    assert lines[7] == "sg's slowest 1 by client TTFT, beside kv's:" and lines[8].startswith("  #3 ")
    assert len(lines) == 9


def test_runs_of_other_requests_are_refused() -> None:
    a = _run([0, 0], [1.0, 2.0])
    with pytest.raises(ValueError, match="same requests"):
        compare(a, list(reversed(a)), ("a", "b"), 0.01)


def test_the_command_reads_two_run_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, cached in (("mooncake-kvgate_kv_aware-5", [16, 0]), ("mooncake-sglang_cache_aware-5", [0, 0])):
        (tmp_path / name).mkdir()
        write_requests(tmp_path / name / REQUESTS_FILE, _run(cached, [5.0, 6.0]))
    runs = sorted(tmp_path.iterdir())
    assert len(read_requests(runs[0])) == 2 and read_requests(runs[0] / REQUESTS_FILE) == read_requests(
        runs[0]
    )
    assert main([str(r) for r in runs]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mooncake-*:\n")  # the runs' common part named once
    assert "kvgate_kv_aware-5: 1 of 2 requests with cached prompt tokens, 16 tokens" in out
    assert "cached tokens differ on 1 requests:" in out
