"""The live bench's stages of the first token (``bench/live_hop.py``): the client's sends matched
to the engines' logged arrivals by prompt key, in order, each split into the hop in, the parse,
the engine and the hop out; and the simulated engine's request log
(``replica_agent/sim_engine/request_log.py``) on a real engine over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.live_hop import Logged, Sent, Stages, read_logs, request_records, send_key, stages
from bench.live_pool import RunMeasure, pooled_row
from replica_agent.sim_engine.engine_hashes import HashFormat
from replica_agent.sim_engine.kv_events import EventEncoding
from replica_agent.sim_engine.options import EngineOptions
from replica_agent.sim_engine.request_log import RequestLog, Stamps, prompt_key
from replica_agent.sim_engine.server import SimEngine
from replica_agent.sim_engine_cli import configure
from router_policies.flags import options_from_flags


def test_each_send_meets_its_own_arrival_in_order() -> None:
    a, b, c = send_key("a"), send_key("b"), send_key("c")
    # "a" sent twice (its second read no first data); "c" reached no engine
    sends: list[Sent] = [(10.0, a, 10.05), (10.5, b, 10.7), (11.0, a, None), (12.0, c, None)]
    arrivals: dict[int, list[Logged]] = {
        a: [(10.004, 10.010, 10.04, 0, 0), (11.002, 11.003, None, 64, 1)],
        # "b" retried elsewhere: the second arrival is extra (and its cached tokens not counted)
        b: [(10.52, 10.60, 10.65, None, 2), (10.9, 10.95, 11.0, 32, 3)],
    }
    got = stages(request_records(sends, arrivals))
    assert sorted(round(h, 6) for h in got.inbound) == [2.0, 4.0, 20.0]
    assert sorted(round(p, 6) for p in got.engine_parse) == [1.0, 6.0, 80.0]
    # only the requests with a first token on both sides: "a"'s first and "b"
    assert sorted(round(e, 6) for e in got.engine_first_token) == [30.0, 50.0]
    assert sorted(round(o, 6) for o in got.outbound) == [10.0, 50.0]
    assert got.hit_requests == 1  # "a"'s second send only
    # an arrival before the first send of its prompt is another request's: skipped
    early = {**arrivals, a: [(9.0, 9.1, 9.2, 16, 0), *arrivals[a]]}
    assert stages(request_records(sends, early)) == got


def test_logs_are_read_across_engines_earliest_first_and_a_missing_log_is_empty(tmp_path: Path) -> None:
    k = send_key("x")
    (tmp_path / "e0.jsonl").write_text(
        json.dumps({"arrived": 5.0, "parsed": 5.5, "first": None, "key": k, "cached": None}) + "\n"
    )
    (tmp_path / "e1.jsonl").write_text(
        json.dumps({"arrived": 2.0, "parsed": 2.1, "first": 2.5, "key": k, "cached": 48}) + "\n"
    )
    got = read_logs([tmp_path / "e0.jsonl", tmp_path / "e1.jsonl", tmp_path / "none.jsonl"])
    assert got == {k: [(2.0, 2.1, 2.5, 48, 1), (5.0, 5.5, None, None, 0)]}


def test_prompt_keys_name_completions_and_chats_and_nothing_else() -> None:
    assert prompt_key({"prompt": "hi"}) == send_key("hi") != send_key("hj")
    chat = prompt_key({"messages": [{"role": "user", "content": "hi"}]})
    assert chat is not None and chat == prompt_key({"messages": [{"content": "hi", "role": "user"}]})
    assert prompt_key({"prompt": [1, 2, 3]}) is None and prompt_key([1]) is None


def test_the_log_stops_at_its_bound(tmp_path: Path) -> None:
    log = RequestLog(tmp_path / "r.jsonl", max_lines=2)
    for i in range(5):
        log.record(Stamps(prompt_key({"prompt": f"p{i}"}), float(i), float(i) + 0.5))
    log.record(Stamps(None, 9.0, 9.5))  # no key: not a line, not skipped
    log.close()
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2 and log.skipped == 3


def test_a_requests_first_token_stamp_keeps_the_first() -> None:
    s = Stamps(1, 1.0, 2.0)
    s.first_token(3.0)
    s.first_token(4.0)
    assert s.first == 3.0


def test_the_pooled_row_reports_each_stage_or_none() -> None:
    def run(seed: int, hop: list[float]) -> RunMeasure:
        n = len(hop)
        # every other request without a first token on both sides: no engine or hop-out figure
        staged = Stages(hop, [1.0] * n, [20.0] * (n // 2), [0.5] * (n // 2), hit_requests=seed)
        return RunMeasure(seed, "kv_aware", [200], [10.0], 1.0, 1.0, 2.0, [2.0], {}, {}, staged)

    row = pooled_row([run(5, [1.0, 2.0, 3.0]), run(6, [4.0, 5.0])])
    assert row["inbound_p50_ms"] == 3.0 and row["engine_parse_p50_ms"] == 1.0
    assert row["engine_first_token_p50_ms"] == 20.0 and row["outbound_p99_ms"] == 0.5
    assert row["engine_hit_requests"] == 11
    empty = pooled_row([run(5, [])])
    assert empty["inbound_p50_ms"] is None and empty["outbound_p50_ms"] is None


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
            "/v1/completions",
            {"model": "kvgate-sim", "prompt": "hello " * 200, "max_tokens": 3, "stream": True},
        ),
        (
            "/v1/chat/completions",
            {"model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
        (
            "/v1/chat/completions",
            {
                "model": "kvgate-sim",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "stream": True,
            },
        ),
    ],
)
def test_the_engine_logs_each_requests_arrival_parse_and_first_token(
    tmp_path: Path, path: str, body: dict[str, object]
) -> None:
    log = tmp_path / "engine_requests.jsonl"

    again_usage: dict[str, Any] = {}

    async def main() -> tuple[float, float | None, float]:
        engine = SimEngine(_options(log))
        bound = await engine.start()
        try:
            async with aiohttp.ClientSession() as http:
                sent, read = time.monotonic(), None
                async with http.post(bound.http + path, json=body) as resp:
                    assert resp.status == 200
                    async for chunk in resp.content.iter_any():
                        if read is None and b"data:" in chunk:
                            read = time.monotonic()
                done = time.monotonic()
                usage_body = {**body, "stream": False}  # the second time, read its usage whole
                async with http.post(bound.http + path, json=usage_body) as resp:
                    again_usage.update((await resp.json())["usage"])
                return sent, read, done
        finally:
            await engine.stop()

    sent, read, done = asyncio.run(main())
    first, again = (json.loads(line) for line in log.read_text().splitlines())
    rec = first
    assert rec["key"] == again["key"] == prompt_key(body)
    assert sent <= rec["arrived"] <= rec["parsed"] <= done  # one clock for client and engine
    if body.get("stream"):
        assert read is not None and rec["parsed"] <= rec["first"] <= read
    else:  # a whole answer: no first token written on its own
        assert rec["first"] is None
    # the engine's cached prompt tokens, as its usage reports them: none the first time; the same
    # prompt again is served from the cache when it spans a whole block (the long prompts)
    assert rec["cached"] == 0
    assert again["cached"] == again_usage["prompt_tokens_details"]["cached_tokens"]
    assert (again["cached"] > 0) == (len(str(body.get("prompt", ""))) > 100)


def test_a_tokenize_call_is_not_a_generation_request_and_is_not_logged(tmp_path: Path) -> None:
    log = tmp_path / "engine_requests.jsonl"
    body = {"model": "kvgate-sim", "prompt": "hello " * 50}

    async def main() -> None:
        engine = SimEngine(_options(log))
        bound = await engine.start()
        try:
            async with aiohttp.ClientSession() as http:
                # vllm-router's kv_aware asks each engine for the prompt's tokens first
                async with http.post(bound.http + "/tokenize", json=body) as resp:
                    assert resp.status == 200
                async with http.post(bound.http + "/v1/completions", json={**body, "max_tokens": 1}) as resp:
                    assert resp.status == 200
                    await resp.read()
        finally:
            await engine.stop()

    asyncio.run(main())
    (line,) = log.read_text().splitlines()  # the completion's only
    assert json.loads(line)["key"] == prompt_key(body)
