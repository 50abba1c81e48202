"""The proxy on real processes: ``kvgate serve`` in front of fake backends on loopback."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from typing import Any

import aiohttp
import pytest

from tests.integration.gateway_harness import REPO, Procs, base_config, http
from tests.polling import wait_until

JSON = {"content-type": "application/json"}


def _post(url: str, doc: object, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    return http("POST", url, json.dumps(doc).encode(), {**JSON, **(headers or {})})


def test_non_streaming_and_streaming_bytes_identical(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    bodies = [
        {"model": "m", "prompt": "Say something ünicode ✓", "max_tokens": 3},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        {"model": "m", "prompt": "stream me", "stream": True},
        {"model": "m", "messages": [{"role": "user", "content": "s"}], "stream": True,
         "stream_options": {"include_usage": True}},
    ]  # fmt: skip
    for body in bodies:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        # odd whitespace: the gateway must forward these bytes, not a re-serialisation
        raw = json.dumps(body, indent=3).encode()
        s1, h1, direct = http("POST", b.url + path, raw, JSON)
        s2, h2, proxied = http("POST", gw.url + path, raw, JSON)
        assert (s1, s2) == (200, 200)
        assert proxied == direct
        assert h2["content-type"] == h1["content-type"]
        assert h2["x-kvgate-replica"] == "r0"
        assert "x-kvgate-matched-tokens" in h2
    assert "transfer-encoding" not in h2 or h2["transfer-encoding"] == "chunked"


def test_upstream_connections_are_reused_after_complete_streams(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    for i in range(5):
        body = {"model": "m", "prompt": f"s{i}", "stream": i % 2 == 0}
        assert _post(gw.url + "/v1/completions", body)[0] == 200
    stats = b.stats()
    assert stats["requests"] == 5 and stats["connections"] == 1


def test_responses_over_the_buffer_bound_pass_through_unchanged(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b, proxy={"max_buffered_response_bytes": 64}))
    raw = json.dumps(
        {"model": "m", "prompt": "a body larger than 64 bytes comes back", "max_tokens": 3}
    ).encode()
    s1, _, direct = http("POST", b.url + "/v1/completions", raw, JSON)
    s2, headers, proxied = http("POST", gw.url + "/v1/completions", raw, JSON)
    assert (s1, s2) == (200, 200) and len(direct) > 64
    assert proxied == direct
    assert headers["x-kvgate-replica"] == "r0"


def test_debug_headers_can_be_switched_off(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b, proxy={"debug_headers": False}))
    status, headers, _ = _post(gw.url + "/v1/completions", {"model": "m", "prompt": "x"})
    assert status == 200
    assert "x-kvgate-replica" not in headers and "x-kvgate-matched-tokens" not in headers


def _raw_post(
    port: int, path: str, body: bytes, headers: list[tuple[str, str]]
) -> tuple[int, dict[str, str]]:
    """One request on a raw socket, so that the client library adds or rewrites no header (urllib
    replaces Connection); the response is read to the close asked for."""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, *lines = data.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
    out = {}
    for line in lines:
        k, _, v = line.partition(":")
        out[k.strip().lower()] = v.strip()
    return int(status_line.split()[1]), out


def test_hop_by_hop_headers_are_not_forwarded(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    for stream in (False, True):
        body = json.dumps({"model": "m", "prompt": "x", "stream": stream}).encode()
        status, headers = _raw_post(
            gw.port, "/v1/completions", body,
            [("Content-Type", "application/json"), ("Connection", "close, x-private"), ("X-Private", "secret"),
             ("TE", "trailers"), ("Proxy-Authorization", "Basic abc"), ("X-End-To-End", "kept"),
             ("Authorization", "Bearer k")],
        )  # fmt: skip
        assert status == 200
        seen = set(headers["x-fake-seen-headers"].split(","))
        assert {"x-end-to-end", "authorization", "content-type"} <= seen
        assert not seen & {"x-private", "te", "proxy-authorization"}
        # the replica's hop-by-hop header does not reach the client either
        assert "proxy-authenticate" not in headers


async def test_sse_is_passed_through_chunk_by_chunk(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "slow", "stream": True}) as resp,
    ):
        first = await resp.content.readuntil(b"\n\n")
        assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "alpha"
        # the first event arrived while the replica is still generating the rest
        assert (await asyncio.to_thread(b.stats))["active"] == 1
        rest = await resp.read()
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_client_disconnect_frees_the_upstream_slot(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(
            s.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "hang-forever", "stream": True})
        )
        await asyncio.to_thread(wait_until, lambda: b.stats()["active"] == 1, what="backend busy")
        assert gw.replicas()["r0"]["in_flight_requests"] == 1
        task.cancel()  # the client goes away before any byte
        await asyncio.gather(task, return_exceptions=True)
    await asyncio.to_thread(wait_until, lambda: b.stats()["active"] == 0, what="backend slot freed")
    assert b.stats()["cancelled"] == 1
    await asyncio.to_thread(
        wait_until, lambda: gw.replicas()["r0"]["in_flight_requests"] == 0, what="gateway in-flight released"
    )
    assert gw.replicas()["r0"]["pending_prefill_tokens"] == 0


def test_replica_killed_before_first_byte_is_retried_elsewhere(procs: Procs) -> None:
    r0, r1 = procs.backend("r0"), procs.backend("r1")
    gw = procs.gateway(base_config(r0, r1))  # round_robin from seed 0: the first request goes to r0
    status, headers, body = _post(
        gw.url + "/v1/completions", {"model": "m", "prompt": "die-before-first-byte@r0"}
    )
    assert status == 200, body
    assert headers["x-kvgate-replica"] == "r1"
    assert json.loads(body)["served_by"] == "r1"
    assert r0.proc.wait(5) == 3  # r0 really died on that request
    reps = gw.replicas()
    assert reps["r0"]["healthy"] is False and reps["r0"]["failures"] == 1
    assert 'kvgate_retries_total{reason="disconnect"} 1.0' in gw.metrics()
    # and the fleet carries on without r0
    for _ in range(3):
        s, h, _b = _post(gw.url + "/v1/completions", {"model": "m", "prompt": "after"})
        assert (s, h["x-kvgate-replica"]) == (200, "r1")


def test_ejected_replica_recovers_when_it_answers_again(procs: Procs) -> None:
    r0, r1 = procs.backend("r0"), procs.backend("r1")
    gw = procs.gateway(base_config(r0, r1))
    r0.proc.send_signal(signal.SIGKILL)
    r0.proc.wait()
    wait_until(lambda: not gw.replicas()["r0"]["healthy"], what="r0 ejected")
    for _ in range(4):  # everything goes to r1 meanwhile
        assert _post(gw.url + "/v1/completions", {"model": "m", "prompt": "x"})[1]["x-kvgate-replica"] == "r1"
    procs.backend("r0", port=r0.port)  # the replica comes back at its address
    wait_until(lambda: gw.replicas()["r0"]["healthy"], what="r0 restored by health checks")
    served = {
        _post(gw.url + "/v1/completions", {"model": "m", "prompt": "x"})[1]["x-kvgate-replica"]
        for _ in range(4)
    }
    assert served == {"r0", "r1"}  # round robin over both again


def test_503_before_first_byte_is_retried(procs: Procs) -> None:
    r0, r1 = procs.backend("r0"), procs.backend("r1")
    gw = procs.gateway(base_config(r0, r1))
    prompt = "overloaded@r0 " + "a long enough prompt to fill several blocks " * 8
    status, headers, _ = _post(gw.url + "/v1/completions", {"model": "m", "prompt": prompt})
    assert (status, headers["x-kvgate-replica"]) == (200, "r1")
    assert 'kvgate_retries_total{reason="503"} 1.0' in gw.metrics()
    # the speculative entries went with the request: the failed attempt's were undone
    _, index = gw.admin("GET", "/admin/index")
    assert index["replicas"]["r0"]["approximate"] == 0
    assert index["replicas"]["r1"]["approximate"] > 0


@pytest.mark.parametrize(
    ("replicas", "proxy", "prompt", "status", "error"),
    [
        # the replica's own 503, passed through when retries are spent
        (1, {"retries": 0}, "overloaded@r0", 503, {"message": "overloaded"}),
        # every replica failed before its first byte
        (
            2,
            {"retries": 1},
            "die-before-first-byte@r0 die-before-first-byte@r1",
            502,
            {"code": "upstream_error", "type": "upstream_error"},
        ),
        # the per-request timeout (the upstream request is cancelled, checked below)
        (1, {"request_timeout_s": 0.5}, "hang-forever", 504, {"code": "upstream_timeout"}),
    ],
    ids=["503-retries-spent", "502-failure-everywhere", "504-request-timeout"],
)
def test_upstream_failures_are_openai_errors(
    procs: Procs, replicas: int, proxy: dict[str, Any], prompt: str, status: int, error: dict[str, str]
) -> None:
    backends = [procs.backend(f"r{i}") for i in range(replicas)]
    gw = procs.gateway(base_config(*backends, proxy=proxy))
    got, _, body = _post(gw.url + "/v1/completions", {"model": "m", "prompt": prompt})
    assert got == status
    err = json.loads(body)["error"]
    assert {k: err[k] for k in error} == error
    if status == 504:
        wait_until(lambda: backends[0].stats()["active"] == 0, what="the upstream request cancelled")


async def test_replica_killed_mid_stream_ends_that_stream_only(procs: Procs) -> None:
    r0, r1 = procs.backend("r0"), procs.backend("r1")
    gw = procs.gateway(base_config(r0, r1))
    async with aiohttp.ClientSession() as s:

        async def stream(prompt: str) -> tuple[str, bytes]:
            body = {"model": "m", "prompt": prompt, "stream": True}
            async with s.post(gw.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                return resp.headers["x-kvgate-replica"], await resp.read()

        # round robin: the first goes to r0 (which dies after two chunks), the second to r1. The
        # second is sent once the first is answering (routed), not merely sent: two requests
        # sent together may reach the gateway in either order
        body = {"model": "m", "prompt": "slow die-mid-stream@r0", "stream": True}
        async with s.post(gw.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            rep0 = resp.headers["x-kvgate-replica"]
            second = asyncio.ensure_future(stream("slow other stream"))
            dying = await resp.read()
        rep1, healthy = await second
    assert (rep0, rep1) == ("r0", "r1")
    events = [e for e in dying.decode().split("\n\n") if e]
    assert len(events) == 4  # two chunks, the error event, [DONE]
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "alpha"
    err = json.loads(events[2].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error" and "r0" in err["message"]
    assert events[3] == "data: [DONE]"
    # the other stream is whole, byte for byte what r1 sends
    _, _, direct = http(
        "POST",
        r1.url + "/v1/completions",
        json.dumps({"model": "m", "prompt": "slow other stream", "stream": True}).encode(),
        JSON,
    )
    assert healthy == direct
    assert r0.proc.wait(5) == 4


def test_error_rows(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b, proxy={"max_body_bytes": 2000}))
    url = gw.url + "/v1/completions"

    def err(status: int, raw: bytes) -> dict[str, object]:
        s, h, body = http("POST", url, raw, JSON)
        assert s == status, body
        assert h["content-type"].startswith("application/json")
        doc = json.loads(body)
        assert set(doc["error"]) == {"message", "type", "param", "code"}
        out: dict[str, object] = doc["error"]
        return out

    assert err(400, b'{"model": "m", "prompt": ')["code"] == "invalid_json"
    assert err(400, b"[1, 2]")["type"] == "invalid_request_error"
    assert err(400, b'{"prompt": "x"}')["param"] == "model"
    e = err(404, b'{"model": "nope", "prompt": "x"}')
    assert (e["param"], e["code"], e["type"]) == ("model", "model_not_found", "not_found_error")
    assert err(413, json.dumps({"model": "m", "prompt": "x" * 3000}).encode())["code"] == "body_too_large"
    # chunked upload over the limit (no Content-Length)
    s, _, body = http("POST", url, iter([b'{"model": "m", "prompt": "', b"y" * 3000, b'"}']), JSON)  # type: ignore[arg-type]
    assert s == 413, body


def test_no_healthy_replica_is_503_and_not_ready(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    assert http("GET", gw.url + "/ready")[0] == 200
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait()
    wait_until(lambda: not gw.replicas()["r0"]["healthy"], what="r0 ejected by health checks")
    status, _, body = _post(gw.url + "/v1/completions", {"model": "m", "prompt": "x"})
    assert status == 503
    assert json.loads(body)["error"]["code"] == "no_healthy_replica"
    s, _, ready = http("GET", gw.url + "/ready")
    assert s == 503 and json.loads(ready)["error"]["code"] == "not_ready"
    assert http("GET", gw.url + "/health")[0] == 200  # the gateway itself is alive


def test_models_is_the_union_over_healthy_replicas(procs: Procs) -> None:
    a, b, c = procs.backend("r0", "m1"), procs.backend("r1", "m2"), procs.backend("r2", "m3")
    gw = procs.gateway(base_config(a, b, c))
    c.proc.send_signal(signal.SIGKILL)
    c.proc.wait()
    wait_until(lambda: not gw.replicas()["r2"]["healthy"], what="r2 ejected")
    status, _, body = http("GET", gw.url + "/v1/models")
    assert status == 200
    doc = json.loads(body)
    assert doc["object"] == "list"
    assert sorted(m["id"] for m in doc["data"]) == ["m1", "m2"]
    # a model served only by an unhealthy replica exists but has nowhere to go
    assert _post(gw.url + "/v1/completions", {"model": "m3", "prompt": "x"})[0] == 503
    assert _post(gw.url + "/v1/completions", {"model": "m2", "prompt": "x"})[1]["x-kvgate-replica"] == "r1"


def test_unknown_paths_and_methods_get_openai_errors(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]:
        s, h, body = http(method, gw.url + path)
        assert s == status
        assert h["content-type"].startswith("application/json")
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_ports_in_use_are_a_clear_start_up_error(procs: Procs) -> None:
    path = procs.write_config({"models": [{"name": "m"}]})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag in ("--listen", "--inventory"):
            other = "--inventory" if flag == "--listen" else "--listen"
            out = subprocess.run(
                [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path),
                 flag, f"127.0.0.1:{port}", other, "127.0.0.1:0"],
                capture_output=True, text=True, cwd=REPO, timeout=120,
            )  # fmt: skip
            assert out.returncode == 2, out.stderr
            assert "cannot listen" in out.stderr and str(port) in out.stderr
            assert "Traceback" not in out.stderr
