"""A small closed-loop HTTP/1.1 load generator for the benchmarks (raw asyncio streams on uvloop,
keep-alive, no client framework, so that the client costs little of the machine's CPU).

``concurrency`` workers each hold one connection and send requests back to back, taking the next
request body from a seeded list, until ``count`` requests are done or ``max_seconds`` passed. The
first ``warmup`` requests are excluded from the statistics. Per request it records the status,
the time to the first body byte (for a streamed answer: the first SSE chunk, i.e. client TTFT)
and the time to the end of the answer.
"""

from __future__ import annotations

import asyncio
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


def chat_bodies(
    n: int, prompt_bytes: int, stream: bool, seed: int, model: str = "bench-model", sessions: int = 16
) -> list[bytes]:
    """``n`` chat requests of about ``prompt_bytes`` of text each: a system prompt shared by the
    requests of one of ``sessions`` sessions (a quarter of the size) and a user message cut at a
    seeded offset of the local corpus."""
    import orjson

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
            "max_tokens": 8,
            "stream": stream,
        }
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
