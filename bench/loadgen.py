"""A small closed-loop HTTP/1.1 load generator for the benchmarks (raw asyncio streams on uvloop,
keep-alive, no client framework, so that the client costs little of the machine's CPU).

``concurrency`` workers each hold one connection and send requests back to back, taking the next
request body from a seeded list, until ``count`` requests are done or ``max_seconds`` passed. The
first ``warmup`` requests are excluded from the statistics. Per request it records the status,
the time to the first body byte (for a streamed answer: the first SSE chunk, i.e. client TTFT)
and the time to the end of the answer.

``run_streams`` is the same for long streamed answers, read by a protocol (no stream reader, so
the client's cost per event stays small): it sends each body once and records, per answer, the
arrival time of every SSE event (client TTFT, and the gaps between consecutive events).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "assets/corpus/stdlib_docstrings.txt"


@dataclass
class Sample:
    status: int
    ttfb_s: float
    total_s: float


@dataclass
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0

    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.status == 200]

    def summary(self) -> dict[str, float]:
        ok = self.ok()
        total = np.array([s.total_s for s in ok]) * 1e3 if ok else np.zeros(1)
        ttfb = np.array([s.ttfb_s for s in ok]) * 1e3 if ok else np.zeros(1)
        return {
            "requests": len(self.samples),
            "ok": len(ok),
            "errors": self.errors + len(self.samples) - len(ok),
            "wall_s": self.wall_s,
            "rps": len(ok) / self.wall_s if self.wall_s else 0.0,
            "p50_ms": float(np.percentile(total, 50)),
            "p99_ms": float(np.percentile(total, 99)),
            "ttfb_p50_ms": float(np.percentile(ttfb, 50)),
            "ttfb_p99_ms": float(np.percentile(ttfb, 99)),
        }


@dataclass(frozen=True)
class Answer:
    """What the requests ask for: ``max_tokens``, and ``stream_options.include_usage`` (a
    streamed answer that ends with a usage event)."""

    max_tokens: int = 8
    include_usage: bool = False


def chat_bodies(
    n: int,
    prompt_bytes: int,
    stream: bool,
    seed: int,
    model: str = "bench-model",
    answer: Answer = Answer(),
) -> list[bytes]:
    """``n`` chat requests of about ``prompt_bytes`` of text each: a system prompt shared by the
    requests of one of 16 sessions (a quarter of the size) and a user message cut at a seeded
    offset of the local corpus."""
    import orjson

    sessions = 16
    rng = random.Random(seed)
    text = CORPUS.read_text(encoding="utf-8")
    sys_len = prompt_bytes // 4
    systems = []
    for _ in range(sessions):
        off = rng.randrange(0, len(text) - sys_len)
        systems.append(text[off : off + sys_len])
    bodies = []
    user_len = prompt_bytes - sys_len
    for _ in range(n):
        off = rng.randrange(0, len(text) - user_len)
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": systems[rng.randrange(sessions)]},
                {"role": "user", "content": text[off : off + user_len]},
            ],
            "max_tokens": answer.max_tokens,
            "stream": stream,
        }
        if stream and answer.include_usage:
            body["stream_options"] = {"include_usage": True}
        bodies.append(orjson.dumps(body))
    return bodies


def request_bytes(host: str, path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes) -> Sample:
    t0 = time.perf_counter()
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = -1
    chunked = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        lname = name.strip().lower()
        if lname == b"content-length":
            length = int(value)
        elif lname == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    ttfb = 0.0
    if chunked:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # end of (empty) trailers
                break
            await reader.readexactly(size + 2)
            if not ttfb:
                ttfb = time.perf_counter() - t0
    elif length >= 0:
        await reader.readexactly(length)
        ttfb = time.perf_counter() - t0
    else:
        await reader.read()
        ttfb = time.perf_counter() - t0
        writer.close()
    return Sample(status, ttfb, time.perf_counter() - t0)


async def run(
    host: str,
    port: int,
    path: str,
    bodies: list[bytes],
    count: int,
    concurrency: int,
    max_seconds: float,
    warmup: int = 0,
    extra_headers: dict[str, str] | None = None,
) -> RunResult:
    """Send ``count`` (+ ``warmup``) requests with ``concurrency`` connections; bodies are taken
    round-robin from ``bodies``."""
    reqs = [request_bytes(f"{host}:{port}", path, b) for b in bodies]
    if extra_headers:
        extra = "".join(f"{k}: {v}\r\n" for k, v in extra_headers.items()).encode()
        reqs = [r.replace(b"\r\n\r\n", b"\r\n" + extra + b"\r\n", 1) for r in reqs]
    result = RunResult()
    next_i = 0
    total = count + warmup
    deadline = time.perf_counter() + max_seconds
    started = 0.0

    async def worker() -> None:
        nonlocal next_i, started
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while next_i < total and time.perf_counter() < deadline:
                i = next_i
                next_i += 1
                if i == warmup:
                    started = time.perf_counter()
                try:
                    sample = await _one(reader, writer, reqs[i % len(reqs)])
                except (asyncio.IncompleteReadError, ConnectionError):
                    result.errors += 1
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port)
                    continue
                if sample.status != 200 or writer.is_closing():
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port)
                if i >= warmup:
                    result.samples.append(sample)
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - (started or t0)
    return result


@dataclass
class StreamSample:
    """One streamed answer: status, time to its first SSE event (client TTFT), to its end, and
    the gaps between consecutive events (0 between events that arrived in one read)."""

    status: int
    ttft_s: float
    total_s: float
    events: int
    gaps_s: list[float]


class _StreamConn(asyncio.Protocol):
    """One keep-alive connection that reads chunked SSE answers as they arrive (a protocol, not a
    stream reader, so that the client's cost per event stays small next to the router's)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[StreamSample] | None = None
        self.t0 = 0.0
        self.status = 0  # 0: reading the head
        self.length = -1  # content-length of a non-chunked answer (an error)
        self.times: list[float] = []  # arrival time of each event

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost mid-answer: {exc}"))

    def send(self, req: bytes) -> asyncio.Future[StreamSample]:
        assert self.transport is not None and (self.waiter is None or self.waiter.done())
        self.waiter = asyncio.get_running_loop().create_future()
        self.status, self.length, self.times = 0, -1, []
        self.t0 = time.perf_counter()
        self.transport.write(req)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        buf = self.buf
        buf += data
        if not self.status:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end])
            del buf[: end + 4]
            self.status = int(head[9:12])
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    self.length = int(value)
        if self.length >= 0:  # an error answer, read whole
            if len(buf) >= self.length:
                del buf[: self.length]
                self._finish(now)
            return
        pos = 0
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(buf[pos:eol].split(b";")[0], 16)
            if len(buf) < eol + 2 + size + 2:
                break
            if size == 0:
                pos = eol + 4  # the last chunk, no trailers
                del buf[:pos]
                self._finish(now)
                return
            n = buf.count(b"\n\n", eol + 2, eol + 2 + size)
            self.times.extend([now] * n)
            pos = eol + 2 + size + 2
        del buf[:pos]

    def _finish(self, now: float) -> None:
        t = self.times
        first = t[0] - self.t0 if t else now - self.t0
        gaps = [b - a for a, b in itertools.pairwise(t)]
        assert self.waiter is not None
        self.waiter.set_result(StreamSample(self.status, first, now - self.t0, len(t), gaps))


@dataclass
class StreamRunResult:
    samples: list[StreamSample] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0

    def summary(self) -> dict[str, float]:
        ok = [s for s in self.samples if s.status == 200]
        ttft = np.array([s.ttft_s for s in ok] or [0.0]) * 1e3
        total = np.array([s.total_s for s in ok] or [0.0]) * 1e3
        gaps = np.array([g for s in ok for g in s.gaps_s] or [0.0]) * 1e3
        events = sum(s.events for s in ok)
        return {
            "requests": len(self.samples),
            "ok": len(ok),
            "errors": self.errors + len(self.samples) - len(ok),
            "wall_s": self.wall_s,
            "events": events,
            "events_per_s": events / self.wall_s if self.wall_s else 0.0,
            "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "gap_p50_ms": float(np.percentile(gaps, 50)),
            "gap_p99_ms": float(np.percentile(gaps, 99)),
            "total_p50_ms": float(np.percentile(total, 50)),
        }


async def run_streams(
    host: str,
    port: int,
    path: str,
    bodies: list[bytes],
    concurrency: int,
    max_seconds: float,
    stagger_s: float = 0.0,
) -> StreamRunResult:
    """Send every body of ``bodies`` once (streamed answers), ``concurrency`` at a time on
    keep-alive connections; stops starting new ones after ``max_seconds``. Connection k starts
    ``k * stagger_s / concurrency`` late, so that streams of equal length do not all start (and
    end, and restart) at once."""
    loop = asyncio.get_running_loop()
    reqs = [request_bytes(f"{host}:{port}", path, b) for b in bodies]
    result = StreamRunResult()
    next_i = 0
    deadline = time.perf_counter() + max_seconds

    async def connect() -> _StreamConn:
        _, conn = await loop.create_connection(_StreamConn, host, port)
        return conn

    async def worker(k: int) -> None:
        nonlocal next_i
        conn = await connect()
        await asyncio.sleep(k * stagger_s / concurrency)
        try:
            while next_i < len(reqs) and time.perf_counter() < deadline:
                i = next_i
                next_i += 1
                try:
                    sample = await conn.send(reqs[i])
                except ConnectionError:
                    result.errors += 1
                    conn = await connect()
                    continue
                result.samples.append(sample)
                if sample.status != 200:
                    assert conn.transport is not None
                    conn.transport.close()
                    conn = await connect()
        finally:
            if conn.transport is not None:
                conn.transport.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    result.wall_s = time.perf_counter() - t0
    return result
