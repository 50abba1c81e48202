"""Abuse of the gateway's HTTP side (docs/faults.md): malformed requests (parser-level and
application-level), slow and idle clients, bad configs at start and on reload, against a real
``kvgate serve`` in front of one sim-engine.

Must hold: every error is OpenAI-shaped, ``/health`` never fails, fds and RSS bounded; a bad
config is refused at start (exit 2) and on reload (the running config keeps serving).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvgate_tools.faults.common import (
    Call,
    Result,
    Sampler,
    Tally,
    chat_body,
    fd_count,
    is_openai_error,
    send,
)
from kvgate_tools.faults.malformed_cases import CASES
from kvgate_tools.local_fleet import FleetOptions, LocalFleet
from kvgate_tools.procs import REPO_ROOT, http_ok

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 2.0
RSS_BOUND_MB = 1024.0
FD_SLACK = 32  # open fds may exceed the baseline by this much after abuse


def one_replica(tmp: Path) -> LocalFleet:
    return LocalFleet(
        FleetOptions(
            replicas=1,
            agents=False,
            log_dir=tmp,
            extra_config={
                "server": {"header_timeout_s": HEADER_TIMEOUT_S, "idle_timeout_s": IDLE_TIMEOUT_S},
                "proxy": {
                    "body_timeout_s": BODY_TIMEOUT_S,
                    "max_body_bytes": 1 << 20,
                    "max_prompt_chars": 100_000,
                },
            },
        )
    )


def raw_exchange(port: int, payload: bytes, timeout_s: float = 10.0) -> bytes:
    """Send ``payload`` and read until a whole response arrived, the server closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        with contextlib.suppress(OSError):  # the server may answer and close before reading it all
            s.sendall(payload)
        out = b""
        try:
            while not whole(out) and (chunk := s.recv(65536)):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def final_response(resp: bytes) -> tuple[bytes, bytes]:
    """Head and body of the final response (interim 1xx responses skipped)."""
    head, _, body = resp.partition(b"\r\n\r\n")
    while head.startswith(b"HTTP/1.1 1") and body:
        head, _, body = body.partition(b"\r\n\r\n")
    return head, body


def whole(resp: bytes) -> bool:
    """A final response whose Content-Length worth of body has arrived (no need to wait for close)."""
    head, body = final_response(resp)
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return len(body) >= int(value)
    return False


def kind_of_raw(resp: bytes) -> str:
    """ok (2xx), clear_error (an OpenAI-shaped JSON error), broken (anything else), lost (nothing)."""
    if not resp:
        return "lost"
    head, body = final_response(resp)
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return "broken"
    if 200 <= status < 300:
        return "ok"
    try:
        return "clear_error" if is_openai_error(json.loads(body)) else "broken"
    except ValueError:
        return "broken"


def malformed_http(tmp: Path) -> Result:
    """Every case of ``malformed_cases.CASES`` on its own connection, /health checked after each."""
    tally = Tally()
    bad: list[str] = []
    with one_replica(tmp) as fleet:
        pid = fleet.gateway_proc().pid
        fds_before = fd_count(pid)
        with Sampler(pid) as s:
            for name, payload in CASES:
                start = time.monotonic()
                kind = kind_of_raw(raw_exchange(fleet.gateway_port, payload))
                tally.add(kind, time.monotonic() - start)
                if kind in ("broken", "lost"):
                    bad.append(f"{name}: {kind}")
                if not http_ok(fleet.gateway_url + "/health"):
                    bad.append(f"/health failed after {name}")
        time.sleep(0.5)
        fds_after = fd_count(pid)
    ok = not bad and s.peak_rss_mb < RSS_BOUND_MB and fds_after <= fds_before + FD_SLACK
    notes = f"{len(CASES)} cases; fds {fds_before}->{fds_after}; " + "; ".join(bad)
    return Result("malformed_http", tally, None, s.peak_rss_mb, ok, notes)


DRIPS = {
    "drip headers": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"X-A: b\r\n"),
    "drip body": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n",
        b"{",
    ),
    "idle": (b"", b""),
}


def slow_clients(tmp: Path, per_kind: int = 30) -> Result:
    """``per_kind`` connections each dripping headers, dripping a body, or idle: each is closed
    within its timeout (+ 2 s), with a 408 JSON or nothing; /health answers all along."""
    tally = Tally()
    bad: list[str] = []
    with one_replica(tmp) as fleet:
        pid = fleet.gateway_proc().pid
        fds_before = fd_count(pid)
        socks: list[tuple[str, socket.socket, bytes]] = []
        with Sampler(pid) as s:
            for kind, (first, drip) in DRIPS.items():
                for _ in range(per_kind):
                    c = socket.create_connection(("127.0.0.1", fleet.gateway_port), timeout=10)
                    c.setblocking(False)
                    if first:
                        c.sendall(first)
                    socks.append((kind, c, drip))
            bound = max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S, IDLE_TIMEOUT_S) + 2.0
            answers = drip_until_closed(socks, bound, fleet.gateway_url, bad)
        for (kind, c, _), resp in zip(socks, answers, strict=True):
            # None: still open past the bound; b"": closed without an answer (idle), as it should
            k = "broken" if resp is None else "clear_error" if resp == b"" else kind_of_raw(resp)
            tally.add(k)
            if k == "broken":
                bad.append(f"{kind}: {'not closed' if resp is None else resp[:80]!r}")
            c.close()
        time.sleep(0.5)
        fds_after = fd_count(pid)
    ok = not bad and fds_after <= fds_before + FD_SLACK and s.peak_rss_mb < RSS_BOUND_MB
    notes = f"{len(socks)} slow connections; fds {fds_before}->peak {s.peak_fds}->{fds_after}; " + "; ".join(
        bad[:5]
    )
    return Result("slow_clients", tally, None, s.peak_rss_mb, ok, notes)


def drip_until_closed(
    socks: list[tuple[str, socket.socket, bytes]], bound_s: float, gw: str, bad: list[str]
) -> list[bytes | None]:
    """Drip a byte on each open connection every 0.2 s until it closes (its answer) or ``bound_s``
    passes (None); /health checked each round."""
    answers: list[bytes | None] = [None] * len(socks)
    got: list[bytes] = [b""] * len(socks)
    end = time.monotonic() + bound_s
    while time.monotonic() < end and any(a is None for a in answers):
        for n, (_, c, drip) in enumerate(socks):
            if answers[n] is not None:
                continue
            try:
                if drip:
                    c.send(drip)
                while chunk := c.recv(65536):
                    got[n] += chunk
                    if kind_of_raw(got[n]) == "clear_error":  # answered; aiohttp may linger reading
                        raise BlockingIOError
                answers[n] = got[n]  # recv returned b"": closed
            except BlockingIOError:
                if got[n] and kind_of_raw(got[n]) == "clear_error":
                    answers[n] = got[n]
            except OSError:
                answers[n] = got[n]
        if not http_ok(gw + "/health"):
            bad.append("/health failed while slow clients were connected")
        time.sleep(0.2)
    return answers


BAD_CONFIGS = {
    "empty file": "",
    "invalid YAML": "models: [\n  - {name: x\n",
    "invalid field": "proxy: {retries: -1}\n",
    "model-less": "models: []\nreplicas: []\n",
}


def start_refused(tmp: Path, text: str) -> tuple[int | None, str]:
    """Start a gateway on the config ``text``, no ``KVGATE_*`` variable overriding it; its exit
    code and stderr."""
    path = tmp / "bad.yaml"
    path.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--listen", "127.0.0.1:0"],
        cwd=REPO_ROOT,
        capture_output=True,
        timeout=60,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")},
    )
    return proc.returncode, proc.stderr.strip()


def reload(fleet: LocalFleet) -> tuple[int, bytes]:
    req = urllib.request.Request(fleet.gateway_url + "/admin/reload", b"", fleet.admin_headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def bad_configs(tmp: Path) -> Result:
    """Each bad config refused at start (exit 2, one line, no traceback), on POST /admin/reload
    (400 OpenAI error) and on SIGHUP; the running config keeps serving chat after each."""
    tmp.mkdir(parents=True, exist_ok=True)
    tally = Tally()
    bad: list[str] = []
    for name, text in BAD_CONFIGS.items():
        code, err = start_refused(tmp, text)
        good = code == 2 and "Traceback" not in err
        tally.add("clear_error" if good else "broken")
        if not good:
            bad.append(f"start with {name}: exit {code}: {err[-200:]}")
    with one_replica(tmp) as fleet:
        path = fleet.workdir / "gateway.yaml"
        good_text = path.read_text()
        with Sampler(fleet.gateway_proc().pid) as s:
            for name, text in BAD_CONFIGS.items():
                path.write_text(text)
                status, body = reload(fleet)
                refused = status == 400 and is_openai_error(json.loads(body or b"null"))
                tally.add("clear_error" if refused else "broken")
                fleet.gateway_proc().send_signal(signal.SIGHUP)
                time.sleep(0.3)
                for tag in ("reload", "SIGHUP"):
                    served = send(Call(fleet.gateway_url, chat_body(f"still here? {name}", False)), Tally())
                    if not (refused and served == "ok" and fleet.gateway_proc().poll() is None):
                        bad.append(f"{tag} with {name}: status {status}, then chat {served}")
            path.write_text(good_text)
            status, _ = reload(fleet)
            if status != 200:
                bad.append(f"reload of the good config: {status}")
    notes = f"{len(BAD_CONFIGS)} configs x (start, reload, SIGHUP); " + "; ".join(bad)
    return Result("bad_configs", tally, None, s.peak_rss_mb, not bad, notes)
