"""The stream relay's idle watchdog (gateway/stream_relay.py) on a real aiohttp client stream from a
raw server on loopback: a stalled read is failed after the limit, not before; a stream whose bytes
keep coming, or a relay busy elsewhere (not waiting), is never cut; ``close`` leaves no timer."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.stream_relay import IdleWatch

IDLE_S = 0.3
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _event(i: int) -> bytes:
    data = b"data: %d\n\n" % i
    return b"%x\r\n%s\r\n" % (len(data), data)


class Trickle(asyncio.Protocol):
    """Answers any request with a chunked SSE stream: one event per ``gap_s`` for ``events``
    events, then stalls (never ends the stream)."""

    gap_s = 0.0
    events = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:
            asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        assert isinstance(self.transport, asyncio.WriteTransport)
        self.transport.write(HEAD + _event(0))
        for i in range(1, self.events):
            await asyncio.sleep(self.gap_s)
            if self.transport.is_closing():
                return
            self.transport.write(_event(i))


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, type[Trickle]]]:
    class Server(Trickle):
        pass

    srv = await asyncio.get_running_loop().create_server(Server, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/", Server
    finally:
        srv.close()
        await srv.wait_closed()


async def _relay(url: str) -> tuple[int, float, BaseException | None]:
    """Reads the stream as the relay does; (events read, seconds, the error that ended it)."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session, session.get(url) as up:
        watch = IdleWatch(up.content, IDLE_S)
        t0, events = time.monotonic(), 0
        try:
            while True:
                watch.since = loop.time()
                chunk = await up.content.readany()
                watch.since = math.inf
                events += chunk.count(b"\n\n")
        except TimeoutError as exc:
            return events, time.monotonic() - t0, exc
        finally:
            watch.close()


async def test_a_stalled_read_is_failed_after_the_idle_limit(upstream: tuple[str, type[Trickle]]) -> None:
    url, server = upstream
    server.events, server.gap_s = 3, 0.05
    events, elapsed, exc = await asyncio.wait_for(_relay(url), 5.0)
    assert events == 3 and isinstance(exc, TimeoutError)
    # the last event came at 0.1 s; the wait after it is cut at the limit, not one period later
    assert 0.1 + IDLE_S * 0.9 <= elapsed < 0.1 + IDLE_S * 1.8


async def test_a_stream_that_keeps_sending_is_never_cut(upstream: tuple[str, type[Trickle]]) -> None:
    url, server = upstream
    server.events, server.gap_s = 12, IDLE_S / 3  # 1.2 s in all: four idle limits
    events, elapsed, exc = await asyncio.wait_for(_relay(url), 5.0)
    assert events == 12 and isinstance(exc, TimeoutError)  # cut only once it stalled
    assert elapsed >= 11 * IDLE_S / 3 + IDLE_S * 0.9


async def test_a_relay_not_waiting_on_the_replica_is_not_cut(upstream: tuple[str, type[Trickle]]) -> None:
    url, server = upstream
    server.events = 1
    async with aiohttp.ClientSession() as session, session.get(url) as up:
        watch = IdleWatch(up.content, IDLE_S)
        try:
            await asyncio.sleep(3 * IDLE_S)  # since is inf: e.g. writing to a slow client
            assert up.content.exception() is None
            assert (await up.content.readany()).count(b"\n\n") == 1
        finally:
            watch.close()
        assert watch._handle is None  # closed: no timer left behind
