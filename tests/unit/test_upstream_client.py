"""The proxy's HTTP/1.1 client (gateway/upstream_client.py) against a raw asyncio server that
answers with prepared bytes, written in pieces of every size."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from multidict import CIMultiDict

from gateway.upstream_client import BadResponse, ConnectError, Disconnected, UpstreamClient, UpstreamResponse

BODY = b'{"ok": true, "text": "' + b"x" * 300 + b'"}'
LENGTH = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5;ext=1\r\ndata:\r\n" + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\nx-trailer: 1\r\n\r\n"
)
UNTIL_CLOSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n" + BODY
INTERIM = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n" + LENGTH


async def _post(
    client: UpstreamClient, url: str, body: bytes, headers: CIMultiDict[str], timeout_s: float
) -> UpstreamResponse:
    """A POST as the gateway makes it: ``start`` (written now on an idle connection), ``finish``."""
    return await client.finish(client.start(url, body, headers), timeout_s)


class Server:
    """Answers each request with ``answer`` written ``piece`` bytes at a time; counts connections."""

    def __init__(self, answer: bytes, piece: int, close_after: bool = False) -> None:
        self.answer, self.piece, self.close_after = answer, piece, close_after
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                for i in range(0, len(self.answer), self.piece):
                    writer.write(self.answer[i : i + self.piece])
                    await writer.drain()
                    await asyncio.sleep(0)
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


async def _serve(server: Server) -> tuple[asyncio.AbstractServer, str]:
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    return srv, f"http://127.0.0.1:{port}"


@pytest.fixture
async def serving() -> AsyncIterator[Callable[[Server], asyncio.Future[str]]]:
    started: list[asyncio.AbstractServer] = []

    async def start(server: Server) -> str:
        srv, url = await _serve(server)
        started.append(srv)
        return url

    yield start  # type: ignore[misc]
    for srv in started:
        srv.close()


@pytest.mark.parametrize(
    "answer", [LENGTH, CHUNKED, UNTIL_CLOSE, INTERIM], ids=["length", "chunked", "close", "interim"]
)
@pytest.mark.parametrize("piece", [1, 2, 7, 64, 100_000])
async def test_every_framing_in_pieces_of_every_size(serving, answer: bytes, piece: int) -> None:  # type: ignore[no-untyped-def]
    server = Server(answer, piece, close_after=answer is UNTIL_CLOSE)
    url = await serving(server)
    client = UpstreamClient()
    for _ in range(3):
        up = await _post(client, url + "/v1/x?q=1", b'{"a":1}', CIMultiDict({"x-test": "1"}), 5.0)
        assert up.status == 200
        body = await up.read()
        assert body == (b"data:" + BODY if answer is CHUNKED else BODY)
        up.release()
    # keep-alive: one connection for the three requests, unless the replica closes each
    assert server.connections == (3 if answer is UNTIL_CLOSE else 1) == client.opened
    req = server.requests[0]
    assert (
        req.startswith(b"POST /v1/x?q=1 HTTP/1.1\r\n")
        and b"x-test: 1\r\n" in req
        and req.endswith(b'{"a":1}')
    )
    client.close()


async def _first_request(server: Server, serving, read_all: bool) -> tuple[UpstreamClient, str]:  # type: ignore[no-untyped-def]
    """A client that made one request to ``server`` and released it (read whole or not)."""
    url = await serving(server)
    client = UpstreamClient()
    up = await _post(client, url, b"{}", CIMultiDict(), 5.0)
    await (up.read() if read_all else up.readany())
    up.release()
    return client, url


async def test_a_response_not_read_to_its_end_is_not_reused(serving) -> None:  # type: ignore[no-untyped-def]
    client, url = await _first_request(Server(CHUNKED, 10), serving, read_all=False)
    up = await _post(client, url, b"{}", CIMultiDict(), 5.0)
    assert await up.read() == b"data:" + BODY
    up.release()
    assert client.opened == 2
    client.close()


async def test_a_pooled_connection_closed_by_the_replica_is_replaced(serving) -> None:  # type: ignore[no-untyped-def]
    server = Server(LENGTH, 1000)
    client, url = await _first_request(server, serving, read_all=True)
    for w in server.writers:  # the replica's idle timeout
        w.close()
    await asyncio.sleep(0.05)
    up = await _post(client, url, b"{}", CIMultiDict(), 5.0)
    assert await up.read() == BODY
    assert client.opened == 2
    client.close()


async def test_failures_are_connection_errors(serving) -> None:  # type: ignore[no-untyped-def]
    client = UpstreamClient()
    with pytest.raises(ConnectError):
        await _post(client, "http://127.0.0.1:9/", b"{}", CIMultiDict(), 2.0)
    url = await serving(Server(b"garbage\r\n\r\n", 100))
    with pytest.raises(BadResponse):
        await _post(client, url, b"{}", CIMultiDict(), 2.0)
    cut = LENGTH[: len(LENGTH) - 10]  # the replica dies before the body's end
    url = await serving(Server(cut, 1000, close_after=True))
    up = await _post(client, url, b"{}", CIMultiDict(), 2.0)
    with pytest.raises(Disconnected):
        await up.read()
    up.close()
    bad_chunk = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
    url = await serving(Server(bad_chunk, 100))
    up = await _post(client, url, b"{}", CIMultiDict(), 2.0)
    with pytest.raises(BadResponse):
        await up.read()
    up.close()
    client.close()


async def test_start_writes_on_an_idle_connection_before_any_await(serving) -> None:  # type: ignore[no-untyped-def]
    server = Server(LENGTH, 1000)
    client, url = await _first_request(server, serving, read_all=True)
    out = client.start(url + "/v1/y", b'{"b":2}', CIMultiDict())
    # written synchronously on the pooled connection: the server sees the request before
    # finish() runs
    assert out.sent is not None and not client._idle.get(out.origin)
    await asyncio.sleep(0.05)
    assert len(server.requests) == 2 and server.requests[1].endswith(b'{"b":2}')
    up = await client.finish(out, 5.0)
    assert out.sent is None  # finish took it over: abandon() is then a no-op
    out.abandon()
    assert await up.read() == BODY
    up.release()
    assert client.opened == 1  # the same connection
    client.close()


async def test_start_with_no_idle_connection_writes_nothing_until_finish(serving) -> None:  # type: ignore[no-untyped-def]
    server = Server(LENGTH, 1000)
    url = await serving(server)
    client = UpstreamClient()
    out = client.start(url, b"{}", CIMultiDict())
    assert out.sent is None and client.opened == 0
    up = await client.finish(out, 5.0)
    assert await up.read() == BODY and client.opened == 1
    up.release()
    client.close()


async def test_an_abandoned_start_closes_its_connection(serving) -> None:  # type: ignore[no-untyped-def]
    server = Server(LENGTH, 1000)
    client, url = await _first_request(server, serving, read_all=True)
    out = client.start(url, b"{}", CIMultiDict())
    assert out.sent is not None
    conn = out.sent[0]
    out.abandon()  # the caller failed before finish(): its answer is never read
    assert conn.closed and out.sent is None
    # the next request opens a new connection and is answered
    up = await _post(client, url, b"{}", CIMultiDict(), 5.0)
    assert await up.read() == BODY and client.opened == 2
    up.release()
    client.close()
