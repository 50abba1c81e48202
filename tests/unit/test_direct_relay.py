"""The direct stream relay (gateway/stream_relay.py: ``DirectRelay``) between real sockets on
loopback: a raw replica answering a chunked SSE stream, the gateway's upstream client, an aiohttp
server relaying it (``RelayResponse``), a raw client reading the bytes.

What it must show: the client gets the replica's body in valid chunked framing, as through
``ChunkRelay`` (which a client not taking chunks, HTTP/1.0, still gets); the relay task never reads the body chunk by chunk; a client that does
not read pauses the replica's reading, so the gateway holds a bounded number of bytes, and gets
every byte in order once it reads; a client gone ends the relay with ``ClientGone``; a replica
that stalls is cut by the idle watch; the SSE tail is kept for the audit."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from multidict import CIMultiDict

from gateway.prediction_audit import SseTail
from gateway.stream_relay import (
    CLIENT_HIGH_WATER,
    ChunkRelay,
    ClientGone,
    DirectRelay,
    IdleWatch,
    RelayResponse,
)
from gateway.upstream_client import UpstreamClient, UpstreamResponse
from tests.loopback_app import serving

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


def _event(i: int, size: int) -> bytes:
    data = b"data: %d %s\n\n" % (i, b"x" * size)
    return b"%x\r\n%s\r\n" % (len(data), data)


@dataclass
class Replica:
    """Answers every request with ``events`` events of ``size`` bytes, ``gap_s`` apart (each its own
    chunk, two chunks split across writes at odd places), then ends the body, or stalls."""

    events: int = 20
    size: int = 8
    gap_s: float = 0.0
    stall: bool = False
    transports: list[asyncio.Transport] = field(default_factory=list)

    def body(self) -> bytes:
        return b"".join(_event(i, self.size) for i in range(self.events))

    async def serve(self, transport: asyncio.Transport) -> None:
        transport.write(HEAD)
        for i in range(self.events):
            if self.gap_s:
                await asyncio.sleep(self.gap_s)
            if transport.is_closing():
                return
            ev = _event(i, self.size)
            cut = 3 if i % 2 else len(ev)  # odd events arrive in two reads, mid-frame
            transport.write(ev[:cut])
            if cut < len(ev):
                await asyncio.sleep(0)
                transport.write(ev[cut:])
        if not self.stall:
            transport.write(b"0\r\n\r\n")


class _ReplicaProtocol(asyncio.Protocol):
    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.replica.transports.append(transport)

    def data_received(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:
            asyncio.get_running_loop().create_task(self.replica.serve(self.transport))


@dataclass
class Outcome:
    relay: DirectRelay | ChunkRelay | None = None
    error: BaseException | None = None
    first: int = 0  # body bytes of the handler's first read, sent before the relay started
    tail: bytes = b""
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Gateway:
    """An aiohttp server relaying the replica's stream as ``Upstream._stream`` does: the first bytes
    through aiohttp's writer, the rest through ``DirectRelay`` (or ``ChunkRelay`` when ``direct``
    is off)."""

    def __init__(self, replica_url: str, direct: bool, idle_s: float) -> None:
        self.replica_url, self.direct, self.idle_s = replica_url, direct, idle_s
        self.client = UpstreamClient()
        self.outcome = Outcome()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        out = self.client.start(self.replica_url, b"{}", CIMultiDict())
        up: UpstreamResponse = await self.client.finish(out, 5.0)
        first = await up.readany()
        self.outcome.first = len(first)
        resp = RelayResponse(headers={"content-type": "text/event-stream"})
        writer = await resp.prepare(request)
        assert writer is not None
        tail = SseTail(first)
        watch = IdleWatch(up, self.idle_s)
        o = self.outcome
        try:
            await writer.write(first)
            relay = DirectRelay.over(writer, up, watch, tail) if self.direct else None
            o.relay = relay or ChunkRelay(up, writer, watch, tail)
            await o.relay.run()
            await resp.write_eof()
            up.release()
        except BaseException as exc:
            o.error = exc
            up.close()
        finally:
            watch.close()
            o.tail = tail.value()
            o.done.set()
        return resp


@contextlib.asynccontextmanager
async def _serving(handle: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[int]:
    """An aiohttp server on loopback answering GET / with ``handle``; yields its port."""
    app = web.Application()
    app.router.add_get("/", handle)
    async with serving(app) as port:
        yield port


@contextlib.asynccontextmanager
async def _fleet(
    replica: Replica, direct: bool = True, idle_s: float = 5.0
) -> AsyncIterator[tuple[Gateway, int]]:
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(lambda: _ReplicaProtocol(replica), "127.0.0.1", 0)
    gw = Gateway(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/", direct, idle_s)
    try:
        async with _serving(gw.handle) as port:
            yield gw, port
    finally:
        gw.client.close()
        srv.close()


async def _get(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
    writer.write(REQUEST)
    return reader, writer


def _deframe(raw: bytes) -> bytes:
    """The body of HTTP/1.1 chunked framing ``raw`` (which must end with the last chunk)."""
    out: list[bytes] = []
    pos = 0
    while True:
        end = raw.index(b"\r\n", pos)
        size = int(raw[pos:end], 16)
        pos = end + 2
        if size == 0:
            assert raw[pos:] == b"\r\n"
            return b"".join(out)
        out.append(raw[pos : pos + size])
        assert raw[pos + size : pos + size + 2] == b"\r\n"
        pos += size + 2


async def _body_bytes(port: int) -> bytes:
    """The raw bytes of the response's body (its chunk framing included)."""
    reader, writer = await _get(port)
    head = await reader.readuntil(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    body = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
    writer.close()
    return body


async def test_a_relayed_answers_headers_go_out_with_its_first_bytes() -> None:
    """``RelayResponse`` writes nothing at ``prepare``: the client gets the headers with the first
    bytes, in one read (aiohttp's ``StreamResponse`` sends them at once, on their own)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        resp = RelayResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.5)
        await resp.write(b"data: 1\n\n")
        await resp.write_eof()
        return resp

    async with _serving(handle) as port:
        reader, writer = await _get(port)
        with pytest.raises(TimeoutError):  # nothing while the first bytes are awaited
            await asyncio.wait_for(reader.read(1), 0.25)
        first = await asyncio.wait_for(reader.read(1 << 16), 5)
        assert first.startswith(b"HTTP/1.1 200") and b"data: 1" in first
        writer.close()


async def test_the_client_gets_the_bytes_aiohttps_writer_would_send() -> None:
    replica = Replica(events=40, size=50)
    bodies = []
    for direct in (True, False):
        async with _fleet(replica, direct=direct) as (gw, port):
            bodies.append(await _body_bytes(port))
            await asyncio.wait_for(gw.outcome.done.wait(), 5)
            assert gw.outcome.error is None
            assert gw.outcome.tail.endswith(b"data: 39 " + b"x" * 50 + b"\n\n")  # the audit's tail
            assert gw.outcome.relay is not None
            sent = gw.outcome.first + gw.outcome.relay.sent
            assert sent == len(_deframe(replica.body() + b"0\r\n\r\n"))
    # valid chunked framing, and de-framed the replica's stream, byte for byte, either way
    assert _deframe(bodies[0]) == _deframe(bodies[1]) == _deframe(replica.body() + b"0\r\n\r\n")


async def test_the_relay_task_does_not_read_the_body_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    replica = Replica(events=30, gap_s=0.002)
    async with _fleet(replica) as (gw, port):
        orig = UpstreamResponse.readany
        reads = 0

        async def first_only(self: UpstreamResponse) -> bytes:
            nonlocal reads
            reads += 1
            assert reads == 1, "the direct relay read the body through readany"
            return await orig(self)

        monkeypatch.setattr(UpstreamResponse, "readany", first_only)
        body = await _body_bytes(port)
        await asyncio.wait_for(gw.outcome.done.wait(), 5)
    assert gw.outcome.error is None and body.count(b"data: ") == 30
    assert reads == 1  # the handler's first read; every later piece came from the callback


async def test_a_client_that_does_not_read_pauses_the_replica_and_gets_every_byte_later() -> None:
    replica = Replica(events=1000, size=16 * 1024)  # 16 MB, far more than the socket buffers
    loop = asyncio.get_running_loop()
    async with _fleet(replica) as (gw, port):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, REQUEST)
        await asyncio.sleep(0.5)  # the client reads nothing meanwhile
        relay = gw.outcome.relay
        assert isinstance(relay, DirectRelay) and relay.paused
        assert relay.sent < 8 * 1024 * 1024  # the kernel's buffers hold a few MB at most
        # the gateway holds at most the bound and one read more; the replica, the rest
        assert relay._client.get_write_buffer_size() <= CLIENT_HIGH_WATER + 256 * 1024
        assert replica.transports[0].get_write_buffer_size() > 0
        raw = bytearray()
        while not raw.endswith(b"0\r\n\r\n"):
            data = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10)
            assert data
            raw += data
        sock.close()
        await asyncio.wait_for(gw.outcome.done.wait(), 5)
        assert gw.outcome.error is None and not relay.paused
        expected = replica.body()  # the slow client's body, before the replica answers smaller
        # the replica's connection went back to the pool reading: the next answer comes on it
        replica.events, replica.size = 3, 8
        gw.outcome = Outcome()
        again = await _body_bytes(port)
        await asyncio.wait_for(gw.outcome.done.wait(), 5)
        assert gw.outcome.error is None
        assert _deframe(again) == _deframe(replica.body() + b"0\r\n\r\n")
        assert gw.client.opened == 1
    head, _, body = bytes(raw).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert _deframe(body) == _deframe(expected + b"0\r\n\r\n")  # every byte, in order


async def test_a_client_gone_mid_stream_ends_the_relay_with_client_gone() -> None:
    replica = Replica(events=200, gap_s=0.01)
    async with _fleet(replica) as (gw, port):
        reader, writer = await _get(port)
        await reader.readuntil(b"data: 3 ")
        writer.close()
        await asyncio.wait_for(gw.outcome.done.wait(), 5)
        assert isinstance(gw.outcome.error, ClientGone)
        relay = gw.outcome.relay
        assert isinstance(relay, DirectRelay) and relay.ended
        sent = relay.sent
        await asyncio.sleep(0.05)
        assert relay.sent == sent  # nothing written after the end


async def test_a_stalled_replica_is_cut_by_the_idle_watch() -> None:
    replica = Replica(events=5, gap_s=0.01, stall=True)
    async with _fleet(replica, idle_s=0.3) as (gw, port):
        _reader, writer = await _get(port)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(gw.outcome.done.wait(), 5)
        elapsed = loop.time() - t0
        writer.close()
    assert isinstance(gw.outcome.error, TimeoutError)
    assert 0.3 * 0.9 <= elapsed < 0.05 + 0.3 * 1.8  # after the last event, at the limit


async def test_a_stream_that_keeps_coming_is_not_cut() -> None:
    replica = Replica(events=12, gap_s=0.1)  # 1.2 s in all, four idle limits
    async with _fleet(replica, idle_s=0.3) as (gw, port):
        body = await _body_bytes(port)
        await asyncio.wait_for(gw.outcome.done.wait(), 5)
    assert gw.outcome.error is None and body.count(b"data: ") == 12


async def test_a_response_not_chunked_as_it_comes_is_relayed_through_aiohttps_writer() -> None:
    replica = Replica(events=20)
    async with _fleet(replica) as (gw, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.0\r\nhost: x\r\n\r\n")  # no chunked framing for HTTP/1.0
        raw = await asyncio.wait_for(reader.read(), 5)  # the body ends when the connection closes
        writer.close()
        await asyncio.wait_for(gw.outcome.done.wait(), 5)
    assert isinstance(gw.outcome.relay, ChunkRelay) and gw.outcome.error is None
    assert raw.partition(b"\r\n\r\n")[2] == _deframe(replica.body() + b"0\r\n\r\n")


class _SlowClient:
    """A client transport whose buffer is always over the bound (it never drains by itself)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def get_write_buffer_size(self) -> int:
        return CLIENT_HIGH_WATER + 1


class _Body:
    """A body whose last piece arrives (with its end) while the client is slow."""

    def __init__(self) -> None:
        self.reading = True
        self.sink: DirectRelay | None = None

    async def readany(self) -> bytes:
        raise AssertionError("not read through readany")

    def relay(self, sink: DirectRelay) -> None:
        self.sink = sink
        sink.piece(b"data: last\n\n")  # pauses: the client holds more than the bound
        sink.end(None)  # and the body has ended in the same read

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


async def test_a_body_that_ends_while_the_client_is_slow_leaves_the_replica_reading() -> None:
    """Its connection goes back to the pool: paused there, it would never read an answer again."""

    class _Writer:
        async def write(self, chunk: bytes) -> None:
            raise AssertionError(f"the direct relay writes to the transport, not {chunk!r}")

        async def drain(self) -> None:
            await asyncio.sleep(3600)  # the client never drains: the relay must not wait for it

    writer = _Writer()
    body, client = _Body(), _SlowClient()
    watch = IdleWatch(body, 5.0)  # type: ignore[arg-type]
    try:
        relay = DirectRelay(client, body, writer, watch, None)  # type: ignore[arg-type]
        await asyncio.wait_for(relay.run(), 1.0)
    finally:
        watch.close()
    assert client.written == [b"c\r\ndata: last\n\n\r\n"] and relay.sent == 12
    assert relay.ended and not relay.paused and body.reading
