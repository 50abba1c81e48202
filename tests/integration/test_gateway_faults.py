"""What production does to the gateway (issue 13), on real processes on loopback: a real
``kvgate serve``, fake backends or ``kvgate sim-engine``s with their fault switch, raw sockets.

Bounded memory whatever clients send (RSS of the real process), model-less configs refused,
slow/idle clients timed out and capped, parser errors answered in OpenAI's shape, a stuck engine
failed over before its first byte, a stalled stream cut, drain on shutdown."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate_tools.faults.http_faults import start_refused
from tests.integration.gateway_harness import (
    TOKENIZER,
    Gateway,
    Procs,
    base_config,
    http,
)
from tests.integration.test_sim_engine_harness import Engine, start_engine
from tests.polling import wait_until

JSON = {"content-type": "application/json"}
MiB = 1024 * 1024


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _chat(url: str, text: str, model: str = "m", **extra: Any) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], **extra}).encode()
    return http("POST", url + "/v1/chat/completions", body, JSON, timeout=60)


def _error(raw: bytes) -> dict[str, Any]:
    doc = json.loads(raw)
    err: dict[str, Any] = doc["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    return err


def _metric(gw: Gateway, name: str) -> float:
    for line in gw.metrics().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name}")


# ------------------------------------------------------------------------------------ memory
def test_rss_stays_under_budget_with_distinct_multi_mb_prompts(procs: Procs) -> None:
    """Finding 1: distinct multi-MB chat messages, each sent twice to a model no replica serves
    (tokenized, then 503), grew RSS without bound (252 MB -> 2 GB)."""
    cache = 64 * MiB
    cfg = base_config(replicas=[], proxy={"tokenize_cache_bytes": cache})
    cfg["models"] = [{"name": "m", "tokenizer": str(TOKENIZER)}]
    gw = procs.gateway(cfg)
    start = _rss_mb(gw.proc.pid)
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "cache", "router", "token", "the", "of"]
    peak = start
    for i in range(10):
        text = f"doc {i} " + " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(190_000))
        for _ in range(2):
            status, _, raw = _chat(gw.url, text)
            assert status == 503, raw
            peak = max(peak, _rss_mb(gw.proc.pid))
    held = _metric(gw, 'kvgate_memory_bytes{holder="segment_cache"}')
    assert 0 < held <= cache
    assert _metric(gw, 'kvgate_memory_budget_bytes{holder="segment_cache"}') == cache
    # the cache's budget plus transient encode memory (given back after each large encode);
    # before the budgets the same run grew RSS by ~600 MB
    assert peak - start < cache / MiB + 160, (start, peak)
    # a prompt above proxy.max_prompt_chars is refused before it is encoded
    status, _, raw = _chat(gw.url, "x " * 1_100_000)
    assert status == 400
    assert _error(raw)["code"] == "prompt_too_long"


# ------------------------------------------------------------------------------------ configs
def test_model_less_config_is_refused_at_start(tmp_path: Path) -> None:
    for text in ("", "models: []\n", "policy: {name: round_robin}\n"):
        code, err = start_refused(tmp_path, text)
        assert code == 2, err
        lines = err.splitlines()
        assert len(lines) == 1 and "models: the config defines no model" in lines[0], lines


def test_model_less_config_is_refused_on_reload_and_sighup(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    req = json.dumps({"model": "m", "prompt": "hello"}).encode()
    assert http("POST", gw.url + "/v1/completions", req, JSON)[0] == 200
    gw.config_path.write_text("")
    status, doc = gw.admin("POST", "/admin/reload")
    assert status != 200 and "no model" in doc["error"]["message"]
    assert http("POST", gw.url + "/v1/completions", req, JSON)[0] == 200  # running config kept
    gw.config_path.write_text(yaml.safe_dump({"models": [], "replicas": []}))
    os.kill(gw.proc.pid, signal.SIGHUP)
    wait_until(lambda: gw.stderr().count("reload rejected") >= 2, what="SIGHUP reload rejected")
    assert http("POST", gw.url + "/v1/completions", req, JSON)[0] == 200


# ------------------------------------------------------------------------------------ stuck engine
def _sim_config(engines: list[Engine], **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "models": [{"name": "kvgate-sim", "tokenizer": str(TOKENIZER)}],
        "replicas": [{"id": f"e{i}", "url": e.http} for i, e in enumerate(engines)],
        "policy": {"name": "round_robin", "seed": 0},
        "health": {"interval_s": 0.2, "timeout_s": 1.0, "unhealthy_after": 1, "healthy_after": 1},
    }
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def _faults(e: Engine, body: dict[str, Any]) -> dict[str, Any]:
    status, _, raw = http("POST", e.http + "/debug/faults", json.dumps(body).encode(), JSON)
    assert status == 200, raw
    doc: dict[str, Any] = json.loads(raw)
    return doc


def _url(e: Engine) -> str:
    return e.http if e.http.startswith("http") else "http://" + e.http


@pytest.fixture
def two_engines(tmp_path: Path) -> Iterator[list[Engine]]:
    out = []
    try:
        for _ in range(2):
            e = start_engine(tmp_path)
            e.http = _url(e)
            out.append(e)
        yield out
    finally:
        for e in out:
            os.killpg(e.proc.pid, signal.SIGCONT)
            e.stop(signal.SIGKILL)


def test_a_hung_engine_is_failed_over_after_the_first_byte_timeout(
    procs: Procs, two_engines: list[Engine]
) -> None:
    """Finding 8: requests on a hung engine waited request_timeout_s (600 s)."""
    e0 = two_engines[0]
    timeouts = {"first_byte_timeout_s": 1.0, "request_timeout_s": 1.0}
    gw = procs.gateway(_sim_config(two_engines, proxy=timeouts, health={"unhealthy_after": 100}))
    wait_until(lambda: all(r["healthy"] for r in gw.replicas().values()), what="both healthy")
    _faults(e0, {"hang": 100})  # its /health still answers: only the timeout can tell
    for i in range(4):
        t0 = time.monotonic()
        stream = bool(i % 2)  # streams: first_byte_timeout_s; whole answers: request_timeout_s
        status, headers, raw = _chat(gw.url, f"q {i}", model="kvgate-sim", max_tokens=4, stream=stream)
        assert status == 200, raw
        assert headers["x-kvgate-replica"] == "e1"
        assert time.monotonic() - t0 < 3.0
    assert 'kvgate_retries_total{reason="first_byte_timeout"}' in gw.metrics()


def test_requests_waiting_on_an_ejected_engine_fail_over(procs: Procs, two_engines: list[Engine]) -> None:
    e0 = two_engines[0]
    gw = procs.gateway(_sim_config(two_engines, proxy={"first_byte_timeout_s": 60.0}))
    wait_until(lambda: all(r["healthy"] for r in gw.replicas().values()), what="both healthy")
    os.killpg(e0.proc.pid, signal.SIGSTOP)
    try:
        results: list[tuple[int, str, float]] = []

        def one(i: int) -> None:
            t0 = time.monotonic()
            status, headers, _ = _chat(gw.url, f"q {i}", model="kvgate-sim", max_tokens=4)
            results.append((status, headers.get("x-kvgate-replica", ""), time.monotonic() - t0))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert [r[0] for r in results] == [200, 200]
        assert {r[1] for r in results} == {"e1"}
        assert max(r[2] for r in results) < 6.0  # ejection (health timeout 1 s) then failover
    finally:
        os.killpg(e0.proc.pid, signal.SIGCONT)


def test_a_stalled_stream_is_cut_by_the_idle_timeout(procs: Procs, two_engines: list[Engine]) -> None:
    e0, _ = two_engines
    gw = procs.gateway(_sim_config(two_engines[:1], proxy={"stream_idle_timeout_s": 1.0}))
    wait_until(lambda: gw.replicas()["e0"]["healthy"], what="healthy")
    _faults(e0, {"stall": 1})
    t0 = time.monotonic()
    status, _, raw = _chat(gw.url, "stall", model="kvgate-sim", max_tokens=8, stream=True)
    assert status == 200
    events = [e for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    assert json.loads(events[-2][len("data: ") :])["error"]["code"] == "upstream_timeout"
    assert events[-1] == "data: [DONE]"
    assert time.monotonic() - t0 < 5
    # the stall counted as a failure (ejected, unhealthy_after 1) until the next health check;
    # a healthy stream afterwards is whole
    wait_until(lambda: gw.replicas()["e0"]["healthy"], what="restored")
    status, _, raw = _chat(gw.url, "fine", model="kvgate-sim", max_tokens=8, stream=True)
    assert status == 200 and b'"error"' not in raw


def test_engine_5xx_and_corrupt_payloads(procs: Procs, two_engines: list[Engine]) -> None:
    e0, _ = two_engines
    gw = procs.gateway(_sim_config(two_engines, policy={"name": "consistent_hash"}))
    wait_until(lambda: all(r["healthy"] for r in gw.replicas().values()), what="both healthy")
    # find the engine the session goes to, then make it fail
    hdr = {**JSON, "x-session-id": "s1"}
    body = json.dumps({"model": "kvgate-sim", "prompt": "hello", "max_tokens": 4}).encode()
    target = http("POST", gw.url + "/v1/completions", body, hdr)[1]["x-kvgate-replica"]
    eng = two_engines[int(target[1:])]
    _faults(eng, {"error": 1, "error_status": 503})  # retried on the other replica
    status, headers, _ = http("POST", gw.url + "/v1/completions", body, hdr)
    assert status == 200 and headers["x-kvgate-replica"] != target
    _faults(eng, {"error": 1, "error_status": 500})  # passed through, as today
    status, _, raw = http("POST", gw.url + "/v1/completions", body, hdr)
    assert status == 500 and "injected fault" in raw.decode()
    # a 500 is a passive failure (unhealthy_after 1): back after the next health check
    wait_until(lambda: gw.replicas()[target]["healthy"], what="restored")
    _faults(eng, {"corrupt": 1})  # bytes pass through; the audit must not fail on them
    status, _, raw = http("POST", gw.url + "/v1/completions", body, hdr)
    assert status == 200 and raw.startswith(b'{"id": "corrupt"')
    assert "Traceback" not in gw.stderr()
    assert _faults(e0, {})["requests"]["applied"] is not None


# ------------------------------------------------------------------------------------ drain
def test_shutdown_flips_readiness_then_lets_in_flight_requests_finish(
    procs: Procs, two_engines: list[Engine]
) -> None:
    """Finding 8: shutdown drained for a hard-coded 5 s, with no readiness flip first."""
    e0, _ = two_engines
    # the readiness flip must be seen while the listener is still open (drain_delay_s), on a
    # host that may be slow: a 3 s window
    cfg = _sim_config(two_engines[:1], server={"drain_delay_s": 3.0, "shutdown_grace_s": 15.0})
    gw = procs.gateway(cfg)
    wait_until(lambda: http("GET", gw.url + "/ready")[0] == 200, what="ready")
    _faults(e0, {"slow": 1, "slow_ms": 7000})  # longer than the old hard-coded 5 s grace
    result: list[int] = []
    t = threading.Thread(
        target=lambda: result.append(_chat(gw.url, "slow one", model="kvgate-sim", max_tokens=4)[0])
    )
    t.start()
    wait_until(lambda: gw.replicas()["e0"]["in_flight_requests"] == 1, what="the request in flight")
    os.kill(gw.proc.pid, signal.SIGTERM)
    _, _, raw = wait_until(
        lambda: (r := http("GET", gw.url + "/ready", timeout=2))[0] == 503 and r, 3.0, "/ready 503"
    )
    assert _error(raw)["code"] == "draining"
    t.join(30)
    assert result == [200]
    assert gw.proc.wait(20) == 0


def test_request_bodies_held_at_once_are_bounded(procs: Procs, two_engines: list[Engine]) -> None:
    """Request bodies are a buffer clients fill: beyond server.max_inflight_body_bytes a request
    waits (within proxy.body_timeout_s) for room, then gets 503 overloaded."""
    e0 = two_engines[0]
    cfg = _sim_config(
        two_engines[:1], server={"max_inflight_body_bytes": 3000}, proxy={"body_timeout_s": 1.0}
    )
    gw = procs.gateway(cfg)
    wait_until(lambda: gw.replicas()["e0"]["healthy"], what="healthy")
    _faults(e0, {"slow": 1, "slow_ms": 4000})
    text = "y " * 1000  # a ~2.1 KB body
    first: list[int] = []
    t = threading.Thread(
        target=lambda: first.append(_chat(gw.url, text, model="kvgate-sim", max_tokens=2)[0])
    )
    t.start()
    wait_until(
        lambda: _metric(gw, 'kvgate_memory_bytes{holder="request_bodies"}') > 2000, 5, "first body held"
    )
    assert _metric(gw, 'kvgate_memory_budget_bytes{holder="request_bodies"}') == 3000
    status, _, raw = _chat(gw.url, text, model="kvgate-sim", max_tokens=2)
    assert status == 503 and _error(raw)["code"] == "overloaded"
    t.join(30)
    assert first == [200]
    assert _metric(gw, 'kvgate_memory_bytes{holder="request_bodies"}') == 0
    assert _chat(gw.url, text, model="kvgate-sim", max_tokens=2)[0] == 200
