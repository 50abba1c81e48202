"""The proxy's HTTP/1.1 client to the replicas (docs/architecture.md, "Request path", the last
steps; docs/performance.md, "The hop").

Why not aiohttp's ``ClientSession``: on the request path it cost about a fifth of the gateway's
CPU per request (py-spy: request and response objects, tracing hooks, cookie jar, decompression,
timers), for a job this narrow: one POST with a body already in bytes, to a replica the gateway
trusts, on a keep-alive connection, the answer passed through as it arrives. What it does:

- connections per (host, port, TLS) in a LIFO pool; a connection goes back only when its response
  was read to its end and neither side asked to close; idle ones are dropped after
  ``IDLE_S`` (uvicorn, which vLLM and SGLang run on, closes idle ones after 5 s: such a close is
  seen as ``connection_lost`` and the connection leaves the pool before it is reused);
- the response: status line and headers (at most ``MAX_HEAD`` bytes), then a body delimited by
  Content-Length, chunked transfer encoding (de-chunked here) or the connection's close; bodies
  are passed through as they are (no decompression: Content-Encoding goes to the client as sent);
- flow control both ways: the request body waits for the transport to drain; reading pauses while
  more than ``HIGH_WATER`` bytes of body wait to be read;
- failures are ``UpstreamError``s (``ConnectionError``s): ``ConnectError``, ``ConnectTimeout``,
  ``Disconnected`` (closed before the response ended), ``BadResponse``.

Invariants: a connection belongs to at most one response at a time; a response not read to its
end closes its connection (``release`` and ``close`` both do); a cancelled ``finish`` closes the
connection it was using, and so does an ``Outgoing`` abandoned before ``finish``. A
POST is written by ``start`` (no await) on an idle pooled connection when there is one, so that
the replica has it before the caller's bookkeeping. Event loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from dataclasses import dataclass
from typing import cast
from urllib.parse import SplitResult, urlsplit

from multidict import CIMultiDict

from gateway.upstream_errors import BadResponse, ConnectError, ConnectTimeout, Disconnected, UpstreamError
from gateway.upstream_response import UpstreamResponse

__all__ = [
    "BadResponse",
    "ConnectError",
    "ConnectTimeout",
    "Disconnected",
    "Outgoing",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamResponse",
]

IDLE_S = 4.0  # below uvicorn's default keep-alive (5 s): the gateway drops first
MAX_IDLE_PER_HOST = 256
SPLIT_CACHE_URLS = 1024


Origin = tuple[str, int, bool]  # host, port, TLS


@dataclass(slots=True)
class Outgoing:
    """A POST ``UpstreamClient.start`` began: its bytes, and the response on the pooled
    connection they were written to (None: none was idle, or ``finish`` took it over)."""

    origin: Origin
    data: bytes  # the request's head and body
    sent: tuple[_Conn, UpstreamResponse] | None = None

    def abandon(self) -> None:
        """Never finished (its caller failed first): the connection closes, as a cancelled
        ``finish`` closes it."""
        sent, self.sent = self.sent, None
        if sent is not None:
            sent[1].close()


def origin_of(parts: SplitResult) -> Origin:
    url = parts.geturl()
    tls = parts.scheme == "https"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return parts.hostname, parts.port or (443 if tls else 80), tls


class _Conn(asyncio.Protocol):
    """One connection; feeds the response it currently belongs to."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.response: UpstreamResponse | None = None
        self.idle_since = 0.0
        self._drain: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes while idle: the connection cannot be trusted
            self.close()
            return
        self.response.feed(data)

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None:
            self.response.lost(exc)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(Disconnected("connection closed while sending"))

    def pause_writing(self) -> None:
        self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        if self._drain is not None:
            await self._drain

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamClient:
    def __init__(self, idle_s: float = IDLE_S) -> None:
        self._idle: dict[Origin, deque[_Conn]] = {}
        self._idle_s = idle_s
        self._ssl: ssl.SSLContext | None = None
        self.opened = 0  # connections opened (a test reads it to see reuse)
        # url -> (origin, netloc, request target): the same few URLs (replica x endpoint) every
        # request; a query string makes others, so the memo is emptied when it reaches its bound
        self._split: dict[str, tuple[Origin, str, str]] = {}

    def _take(self, origin: Origin) -> _Conn | None:
        pool = self._idle.get(origin)
        now = time.monotonic()
        while pool:
            conn = pool.pop()  # LIFO: the most recently used is the least likely to be closed
            if not conn.closed and now - conn.idle_since < self._idle_s:
                return conn
            conn.close()
        return None

    def put(self, conn: _Conn) -> None:
        pool = self._idle.setdefault(conn.origin, deque())
        conn.idle_since = time.monotonic()
        pool.append(conn)
        while len(pool) > MAX_IDLE_PER_HOST:
            pool.popleft().close()

    async def _connect(self, origin: Origin, timeout_s: float | None) -> _Conn:
        host, port, tls = origin
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(origin), host, port, ssl=self._ssl if tls else None
                )
        except TimeoutError:
            raise ConnectTimeout(f"connect to {host}:{port} timed out after {timeout_s}s") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        self.opened += 1
        return conn

    def start(self, url: str, body: bytes, headers: CIMultiDict[str]) -> Outgoing:
        """Begin a POST of ``body`` to ``url`` (``http(s)://host:port/path?query``) without
        awaiting: its bytes are handed to an idle pooled connection now when there is one, so the
        replica can start on the request while the caller does its own bookkeeping; ``finish``
        connects otherwise. Never raises for the connection (a write refused here is retried by
        ``finish`` on a new one). ``headers`` must not hold Host, Content-Length, Transfer-Encoding
        or Connection (``filter_headers`` with ``DROP_REQUEST`` drops them)."""
        split = self._split.get(url)
        if split is None:
            if len(self._split) >= SPLIT_CACHE_URLS:
                self._split.clear()
            parts = urlsplit(url)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            split = self._split[url] = (origin_of(parts), parts.netloc, target)
        origin, netloc, target = split
        lines = [f"POST {target} HTTP/1.1\r\nHost: {netloc}\r\nContent-Length: {len(body)}\r\n"]
        lines.extend(f"{k}: {v}\r\n" for k, v in headers.items())
        lines.append("\r\n")
        out = Outgoing(origin, "".join(lines).encode("latin-1") + body)
        conn = self._take(origin)
        if conn is not None:
            with contextlib.suppress(OSError, RuntimeError):  # a transport closing: finish() connects
                out.sent = conn, self._send(conn, out.data)  # (_send closed it)
        return out

    async def finish(self, out: Outgoing, connect_timeout_s: float | None) -> UpstreamResponse:
        """The status and headers of the response to the POST ``out`` (``start``); a cancelled
        ``finish`` closes the connection it was using. A pooled connection the replica closed
        (idle timeout, restart) as the request went out, before any byte of an answer, is replaced
        once by a new one: the pool's others are suspect too."""
        sent, out.sent = out.sent, None
        if sent is not None:
            try:
                return await self._answer(*sent)
            except Disconnected as exc:
                if exc.answered:
                    raise
                for stale in self._idle.pop(out.origin, ()):
                    stale.close()
        conn = await self._connect(out.origin, connect_timeout_s)
        return await self._answer(conn, self._send(conn, out.data))

    def _send(self, conn: _Conn, data: bytes) -> UpstreamResponse:
        resp = UpstreamResponse(conn, self)
        conn.response = resp
        assert conn.transport is not None
        try:
            conn.transport.write(data)  # one send: writelines costs two on uvloop
        except BaseException:
            resp.close()
            raise
        return resp

    @staticmethod
    async def _answer(conn: _Conn, resp: UpstreamResponse) -> UpstreamResponse:
        try:
            await conn.drain()
            await resp.wait_head()
        except BaseException:
            resp.close()
            raise
        return resp

    def close(self) -> None:
        for pool in self._idle.values():
            for conn in pool:
                conn.close()
        self._idle.clear()
