"""The live bench's inbound hop (``bench/live_hop.py``): the client's sends matched to the engines'
logged arrivals by prompt key, in order; and the simulated engine's request log
(``replica_agent/sim_engine/request_log.py``) on a real engine over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from bench.live_hop import inbound_ms, read_logs, send_key
from bench.live_pool import RunMeasure, pooled_row
from replica_agent.sim_engine.engine_hashes import HashFormat
from replica_agent.sim_engine.kv_events import EventEncoding
from replica_agent.sim_engine.options import EngineOptions
from replica_agent.sim_engine.request_log import RequestLog, prompt_key
from replica_agent.sim_engine.server import SimEngine
from replica_agent.sim_engine_cli import configure
from router_policies.flags import options_from_flags


def test_each_send_meets_its_own_arrival_in_order() -> None:
    a, b, c = send_key("a"), send_key("b"), send_key("c")
    sends = [(10.0, a), (10.5, b), (11.0, a), (12.0, c)]  # "a" sent twice; "c" reached no engine
    arrivals = {
        a: [(10.004, 10.010), (11.002, 11.003)],
        b: [(10.52, 10.60), (10.9, 10.95)],  # "b" retried elsewhere: the second arrival is extra
    }
    hop, parse = inbound_ms(sends, arrivals)
    assert sorted(round(h, 6) for h in hop) == [2.0, 4.0, 20.0]
    assert sorted(round(p, 6) for p in parse) == [1.0, 6.0, 80.0]
    # an arrival before the first send of its prompt is another request's: skipped
    early = {**arrivals, a: [(9.0, 9.1), *arrivals[a]]}
    assert inbound_ms(sends, early) == (hop, parse)


def test_logs_are_read_across_engines_earliest_first_and_a_missing_log_is_empty(tmp_path: Path) -> None:
    k = send_key("x")
    (tmp_path / "e0.jsonl").write_text(json.dumps({"arrived": 5.0, "parsed": 5.5, "key": k}) + "\n")
    (tmp_path / "e1.jsonl").write_text(json.dumps({"arrived": 2.0, "parsed": 2.1, "key": k}) + "\n")
    got = read_logs([tmp_path / "e0.jsonl", tmp_path / "e1.jsonl", tmp_path / "none.jsonl"])
    assert got == {k: [(2.0, 2.1), (5.0, 5.5)]}


def test_prompt_keys_name_completions_and_chats_and_nothing_else() -> None:
    assert prompt_key({"prompt": "hi"}) == send_key("hi") != send_key("hj")
    chat = prompt_key({"messages": [{"role": "user", "content": "hi"}]})
    assert chat is not None and chat == prompt_key({"messages": [{"content": "hi", "role": "user"}]})
    assert prompt_key({"prompt": [1, 2, 3]}) is None and prompt_key([1]) is None


def test_the_log_stops_at_its_bound(tmp_path: Path) -> None:
    log = RequestLog(tmp_path / "r.jsonl", max_lines=2)
    for i in range(5):
        log.record(float(i), float(i) + 0.5, {"prompt": f"p{i}"})
    log.record(9.0, 9.5, {"prompt": [1, 2]})  # no key: not a line, not skipped
    log.close()
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2 and log.skipped == 3


def test_the_pooled_row_reports_the_hop_or_none() -> None:
    def run(seed: int, hop: list[float]) -> RunMeasure:
        return RunMeasure(
            seed, "kv_aware", [200], [10.0], 1.0, 1.0, 2.0, [2.0], {}, {}, hop, [1.0] * len(hop)
        )

    row = pooled_row([run(5, [1.0, 2.0, 3.0]), run(6, [4.0, 5.0])])
    assert row["inbound_p50_ms"] == 3.0 and row["engine_parse_p50_ms"] == 1.0
    assert pooled_row([run(5, [])])["inbound_p50_ms"] is None


def _options(log: Path) -> EngineOptions:
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args(
        ["--port", "0", "--events-port", "0", "--time-scale", "0.01", "--request-log", str(log)]
    )
    return options_from_flags(
        EngineOptions,
        args,
        hash_format=HashFormat(args.hash_format),
        event_encoding=EventEncoding(args.event_encoding),
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "kvgate-sim", "prompt": "hello " * 200, "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
    ],
)
def test_the_engine_logs_each_requests_arrival_before_its_parse(
    tmp_path: Path, path: str, body: dict[str, object]
) -> None:
    log = tmp_path / "engine_requests.jsonl"

    async def main() -> tuple[float, float]:
        engine = SimEngine(_options(log))
        bound = await engine.start()
        try:
            async with aiohttp.ClientSession() as http:
                sent = time.monotonic()
                async with http.post(bound.http + path, json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
                return sent, time.monotonic()
        finally:
            await engine.stop()

    sent, done = asyncio.run(main())
    (line,) = log.read_text().splitlines()
    rec = json.loads(line)
    assert rec["key"] == prompt_key(body)
    assert sent <= rec["arrived"] <= rec["parsed"] <= done  # one clock for client and engine
