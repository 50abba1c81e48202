"""Harness of the sim-engine integration tests (no tests here): ``kvgate sim-engine`` as a real
subprocess on ports it picks itself (port 0, read back from its ready line), HTTP helpers, a ZMQ
subscriber and replay client, and an independent re-keying of the event stream (engine hash ->
kvgate key from the parent's key and ``token_ids``) to compare against ``/debug/blocks``.

Every engine is started in its own session and its process group is killed when the test ends
(``kvgate_tools.procs``).
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgpack
import pytest
import zmq

from kvgate_tools.procs import read_line, stop_group
from router_policies.block_keys import chain_keys, root_key
from tests.polling import wait_until

KVGATE = Path(sys.executable).parent / "kvgate"
START_TIMEOUT_S = 60.0
READY = re.compile(r"sim-engine ready http=(\S+) events=(\S+) replay=(\S+)")


@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    http: str
    events: str
    replay: str | None
    stderr_path: Path

    @property
    def events_port(self) -> int:
        return int(self.events.rsplit(":", 1)[1])

    @property
    def replay_port(self) -> int | None:
        return None if self.replay is None else int(self.replay.rsplit(":", 1)[1])

    @property
    def http_port(self) -> int:
        return int(self.http.rsplit(":", 1)[1])

    def stop(self, sig: int = signal.SIGTERM) -> int:
        stop_group(self.proc, sig)
        return self.proc.returncode


def start_engine(tmp: Path, **flags: Any) -> Engine:
    """Start ``kvgate sim-engine``; ``flags`` are CLI flags with underscores (``time_scale=0.1``)."""
    opts: dict[str, Any] = {"port": 0, "events_port": 0, "replay_port": 0, "time_scale": 0.1}
    opts.update(flags)
    cmd = [str(KVGATE), "sim-engine"]
    for name, value in opts.items():
        if value is None:
            continue
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    stderr_path = Path(tempfile.mkstemp(prefix="sim-engine-", suffix=".err", dir=tmp)[1])
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    try:
        m = read_line(proc, READY.pattern, START_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as exc:
        stop_group(proc, signal.SIGKILL)
        raise RuntimeError(f"sim-engine did not start: {exc}\n{stderr_path.read_text()}") from exc
    replay = None if m.group(3) == "-" else m.group(3)
    return Engine(proc, m.group(1), m.group(2), replay, stderr_path)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """A list the test appends started engines to; all are killed at teardown."""
    started: list[Engine] = []
    yield started
    for e in started:
        e.stop(signal.SIGKILL)


@pytest.fixture
def launch(engines: list[Engine], tmp_path: Path) -> Any:
    def _launch(**flags: Any) -> Engine:
        e = start_engine(tmp_path, **flags)
        engines.append(e)
        return e

    return _launch


# ---------------------------------------------------------------------------------------------- HTTP
def request(method: str, url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            payload = resp.read()
            status = resp.status
            ctype = resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        payload = err.read()
        status = err.code
        ctype = err.headers.get("Content-Type", "")
    if "json" in ctype:
        return status, json.loads(payload)
    return status, payload.decode()


def post(url: str, body: Any) -> tuple[int, Any]:
    return request("POST", url, body)


def get(url: str) -> tuple[int, Any]:
    return request("GET", url)


class SseStream:
    """A streaming POST read event by event; ``close()`` drops the connection mid-stream."""

    def __init__(self, base: str, path: str, body: Any) -> None:
        u = urlsplit(base)
        assert u.hostname is not None and u.port is not None
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        self.conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()

    def events(self) -> Iterator[str]:
        while True:
            line = self.resp.readline()
            if not line:
                return
            text = line.decode().rstrip("\n")
            if text.startswith("data: "):
                yield text[len("data: ") :]

    def close(self) -> None:
        self.conn.close()


def read_sse(base: str, path: str, body: Any) -> list[str]:
    s = SseStream(base, path, body)
    try:
        assert s.resp.status == 200, s.resp.read()
        assert s.resp.getheader("Content-Type", "").startswith("text/event-stream")
        return list(s.events())
    finally:
        s.close()


def wait_for(predicate: Any, timeout_s: float = 20.0, what: str = "condition") -> Any:
    """Poll until ``predicate()`` is truthy (a liveness bound, not a timing assertion)."""
    return wait_until(predicate, timeout_s, what, interval_s=0.02)


def assert_error(status: int, body: Any, expect_status: int) -> dict[str, Any]:
    assert status == expect_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == expect_status
    return dict(err)


# ----------------------------------------------------------------------------------------------- ZMQ
@dataclass
class Batch:
    topic: bytes
    seq: int
    payload: bytes
    ts: float = 0.0
    events: list[Any] = field(default_factory=list)
    dp_rank: int | None = None


def decode(topic: bytes, seq_bytes: bytes, payload: bytes) -> Batch:
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    if seq < 0:
        return Batch(topic, seq, payload)
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
    return Batch(topic, seq, payload, ts, events, dp_rank)


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    def recv(self, timeout_s: float = 10.0) -> Batch | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        frames = self.sock.recv_multipart()
        assert len(frames) == 3, frames
        return decode(*frames)

    def drain(self, quiet_s: float = 0.3) -> list[Batch]:
        out: list[Batch] = []
        while (b := self.recv(quiet_s)) is not None:
            out.append(b)
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def replay(endpoint: str, start_seq: int, timeout_s: float = 10.0) -> list[Batch]:
    """vLLM's replay protocol from a DEALER: ``["", start_seq]`` -> batches, then seq -1."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[Batch] = []
        while True:
            assert sock.poll(int(timeout_s * 1000)), "replay: no answer"
            frames = sock.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames
            b = decode(frames[1], frames[2], frames[3])
            if b.seq == -1:
                assert frames[1] == b"" and frames[3] == b""
                return out
            out.append(b)
    finally:
        sock.close(0)
        ctx.term()


def tokens_for(i: int, n: int, shared: int = 0) -> list[int]:
    """A token-id prompt of ``n`` tokens: the first ``shared`` common to every i, the rest unique."""
    common = [(7 * k + 100) % 1800 + 100 for k in range(shared)]
    own = [(31 * i + 13 * k + 5) % 1800 + 100 for k in range(n - shared)]
    return common + own


def warm_up(engine: Engine, sub: Subscriber, block_size: int) -> list[Batch]:
    """Send prompts with fresh blocks until the subscriber sees a batch (ZMQ's slow joiner)."""
    seen: list[Batch] = []
    for i in range(50):
        status, _ = post(
            engine.http + "/v1/completions",
            {"prompt": tokens_for(10_000 + i, block_size + 1), "max_tokens": 1},
        )
        assert status == 200
        b = sub.recv(0.2)
        if b is not None:
            seen.append(b)
            seen.extend(sub.drain())
            return seen
    raise AssertionError("subscriber never received a batch")


class Rekeyer:
    """Independent re-keying of vLLM events into kvgate keys (what the replica agent does)."""

    def __init__(self, model: str, block_size: int) -> None:
        self.root = root_key(model)
        self.block_size = block_size
        self.key_of: dict[Any, int] = {}  # engine hash -> kvgate key (held blocks only)

    def apply(self, ev: Any) -> None:
        kind = ev["type"] if isinstance(ev, dict) else ev[0]
        if kind == "BlockStored":
            if isinstance(ev, dict):
                hashes, parent, tokens, bs = (
                    ev["block_hashes"],
                    ev["parent_block_hash"],
                    ev["token_ids"],
                    ev["block_size"],
                )
            else:
                hashes, parent, tokens, bs = ev[1], ev[2], ev[3], ev[4]
            assert bs == self.block_size
            assert len(tokens) == len(hashes) * bs
            parent_key = self.root if parent is None else self.key_of[parent]
            for h, k in zip(hashes, chain_keys(parent_key, tokens, bs), strict=True):
                self.key_of[h] = k
        elif kind == "BlockRemoved":
            hashes = ev["block_hashes"] if isinstance(ev, dict) else ev[1]
            for h in hashes:
                del self.key_of[h]
        else:
            assert kind == "AllBlocksCleared"
            self.key_of.clear()

    def keys(self) -> list[int]:
        return sorted(self.key_of.values())
