"""Issue 13, findings 5 and 6: slow, idle and too many clients are timed out or refused, and
parser-level errors are answered with OpenAI-shaped JSON and one log line (docs/gateway.md,
"Timeouts")."""

from __future__ import annotations

import socket
import time

from tests.integration.gateway_harness import Procs, base_config, http
from tests.integration.test_gateway_faults import _error
from tests.polling import wait_until


# ------------------------------------------------------------------------------------ HTTP abuse
def _raw(port: int, payload: bytes, timeout: float = 10.0) -> bytes:
    """Send ``payload`` and read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _status_and_body(resp: bytes) -> tuple[int, bytes, str]:
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    ctype = next((h.split(":", 1)[1].strip() for h in lines[1:] if h.lower().startswith("content-type")), "")
    return int(lines[0].split()[1]), body, ctype


def test_parser_errors_are_openai_json_with_one_log_line(procs: Procs) -> None:
    """Finding 6: parser-level errors were text/plain with an ERROR traceback each."""
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(300))
    cases = {
        "bad request line": (b"GARBAGE\r\n\r\n", 400),
        "too many headers": (b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n", 431),
        "64 KB header": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n", 431),
        "TE with CL": (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
        ),
        "bad version": (b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 400),
    }
    before = gw.stderr()
    for name, (payload, want) in cases.items():
        status, body, ctype = _status_and_body(_raw(gw.port, payload))
        assert (status, ctype) == (want, "application/json"), name
        assert _error(body)["type"] == "invalid_request_error", name
    assert http("GET", gw.url + "/health")[0] == 200
    new = gw.stderr()[len(before) :]
    assert "Traceback" not in new and "ERROR" not in new, new
    warned = [line for line in new.splitlines() if "WARNING kvgate.http" in line]
    assert len(warned) == len(cases), warned


def test_slow_and_idle_clients_are_timed_out(procs: Procs) -> None:
    """Finding 5: connections dripping headers, dripping a body or idle stayed open >= 120 s."""
    b = procs.backend("r0")
    cfg = base_config(
        b, server={"header_timeout_s": 1.0, "idle_timeout_s": 2.0}, proxy={"body_timeout_s": 1.0}
    )
    gw = procs.gateway(cfg)

    def drip_headers() -> bytes:
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            out = b""
            for i in range(40):
                try:
                    s.sendall(b"X-Drip-%d: v\r\n" % i)
                except OSError:
                    break
                s.settimeout(0.25)
                try:
                    chunk = s.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                out += chunk
            return out

    t0 = time.monotonic()
    status, body, _ = _status_and_body(drip_headers())
    assert status == 408 and _error(body)["code"] == "header_timeout"
    assert time.monotonic() - t0 < 4
    # a body that never arrives whole
    t0 = time.monotonic()
    payload = b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"model"'
    status, body, _ = _status_and_body(_raw(gw.port, payload, timeout=15))
    assert status == 408 and _error(body)["code"] == "body_timeout"
    assert time.monotonic() - t0 < 13  # 1 s, then aiohttp's lingering read of the rest
    # an idle connection is closed
    t0 = time.monotonic()
    assert _raw(gw.port, b"", timeout=10) == b""
    assert 1.5 < time.monotonic() - t0 < 5
    assert http("GET", gw.url + "/health")[0] == 200


def test_connections_beyond_the_cap_are_refused_and_health_recovers(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b, server={"max_connections": 20, "idle_timeout_s": 1.5}))
    socks = [socket.create_connection(("127.0.0.1", gw.port), timeout=5) for _ in range(30)]
    try:
        refused = 0
        for s in socks[20:]:
            data = s.recv(65536)
            status, body, _ = _status_and_body(data)
            assert status == 503 and _error(body)["code"] == "too_many_connections"
            refused += 1
        assert refused == 10
        # the idle ones are closed after idle_timeout_s; then the listener serves again
        wait_until(
            lambda: http("GET", gw.url + "/health", timeout=2)[0] == 200, 10, "health after idle close"
        )
    finally:
        for s in socks:
            s.close()
