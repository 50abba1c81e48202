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
end closes its connection (``release`` and ``close`` both do); a cancelled ``post`` closes the
connection it was using. Event loop thread only.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from typing import cast
from urllib.parse import urlsplit

from multidict import CIMultiDict

IDLE_S = 4.0  # below uvicorn's default keep-alive (5 s): the gateway drops first
MAX_HEAD = 64 * 1024
MAX_CHUNK_LINE = 4096
HIGH_WATER = 1024 * 1024
MAX_IDLE_PER_HOST = 256


class UpstreamError(ConnectionError):
    pass


class ConnectError(UpstreamError):
    pass


class ConnectTimeout(UpstreamError):
    pass


class Disconnected(UpstreamError):
    def __init__(self, message: str, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered  # some of the response had arrived


class BadResponse(UpstreamError):
    pass


Origin = tuple[str, int, bool]  # host, port, TLS


def origin_of(url: str) -> Origin:
    parts = urlsplit(url)
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


class UpstreamResponse:
    """A replica's response: status and headers, then the body read with ``readany`` (``content``
    is the response itself, so that ``up.content.readany()`` reads as with aiohttp)."""

    def __init__(self, conn: _Conn, pool: UpstreamClient) -> None:
        self._conn = conn
        self._pool = pool
        self._buf = bytearray()
        self._head_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content_length: int | None = None
        self._mode = ""  # "length", "chunked", "eof" (until the connection closes)
        self._left = 0  # body bytes left ("length"), or of the current chunk ("chunked")
        self._chunk_state = "size"  # size | data | crlf | trailer
        self._body: deque[bytes] = deque()
        self._queued = 0
        self._paused = False
        self.done = False  # the whole body has arrived
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._keep = True

    @property
    def content(self) -> UpstreamResponse:
        return self

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/octet-stream").split(";")[0].strip().lower()

    # ---------------------------------------------------------------- fed by the connection
    def feed(self, data: bytes) -> None:
        if self.done:
            self._keep = False  # bytes beyond the response: never reuse
            return
        try:
            if not self._head_done.done():
                self._buf += data
                self._head()
                return
            self._body_bytes(data)
        except BadResponse as exc:
            self._fail(exc)
            self._conn.close()

    def lost(self, exc: Exception | None) -> None:
        self._keep = False
        if self._mode == "eof" and self._head_done.done() and not self.done:
            self._finish()
            return
        if not self.done:
            answered = self._head_done.done() or bool(self._buf)
            self._fail(Disconnected(f"replica closed the connection{f': {exc}' if exc else ''}", answered))

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None:
            self._exc = exc
        if not self._head_done.done():
            self._head_done.set_exception(exc)
            self._head_done.exception()  # retrieved: the caller may be gone
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _head(self) -> None:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD:
                raise BadResponse("response head too long")
            return
        lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        rest = bytes(self._buf[end + 4 :])
        self._buf = bytearray()
        version, _, status = lines[0].partition(" ")
        code = status[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise BadResponse(f"bad status line {lines[0][:100]!r}")
        self.status = int(code)
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise BadResponse(f"bad header line {line[:100]!r}")
            self.headers.add(name, value.strip())
        conn = self.headers.get("connection", "").lower()
        if "close" in conn or (version == "HTTP/1.0" and "keep-alive" not in conn):
            self._keep = False
        self._body_mode()
        self._head_done.set_result(None)
        if rest or self.done:
            self._body_bytes(rest)

    def _body_mode(self) -> None:
        te = self.headers.get("transfer-encoding", "").lower()
        cl = self.headers.get("content-length")
        if self.status in (204, 304) or 100 <= self.status < 200:
            self._mode, self.done = "length", True
        elif te:
            if te.rsplit(",", 1)[-1].strip() != "chunked":
                raise BadResponse(f"unsupported transfer-encoding {te!r}")
            self._mode = "chunked"
        elif cl is not None:
            if not cl.strip().isdigit():
                raise BadResponse(f"bad content-length {cl!r}")
            self.content_length = self._left = int(cl)
            self._mode = "length"
            self.done = self._left == 0
        else:
            self._mode, self._keep = "eof", False

    def _body_bytes(self, data: bytes) -> None:
        if self._mode == "chunked":
            self._dechunk(data)
        elif self._mode == "length":
            if len(data) > self._left:
                self._keep = False
                data = data[: self._left]
            self._left -= len(data)
            self._push(data)
            if self._left == 0:
                self._finish()
        else:
            self._push(data)

    def _dechunk(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        while pos < len(buf) and not self.done:
            if self._chunk_state == "data":
                take = min(len(buf) - pos, self._left)
                self._push(bytes(buf[pos : pos + take]))
                pos += take
                self._left -= take
                if self._left == 0:
                    self._chunk_state = "crlf"
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if len(buf) - pos > MAX_CHUNK_LINE:
                    raise BadResponse("chunk size line too long")
                break
            line = bytes(buf[pos:end])
            pos = end + 2
            if self._chunk_state == "crlf":
                if line:
                    raise BadResponse("chunk not followed by CRLF")
                self._chunk_state = "size"
            elif self._chunk_state == "size":
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise BadResponse(f"bad chunk size {line[:40]!r}") from None
                if size < 0:
                    raise BadResponse("negative chunk size")
                self._left = size
                self._chunk_state = "data" if size else "trailer"
            elif not line:  # the empty line ending the trailers
                self._finish()
        del buf[:pos]
        if self.done and buf:
            self._keep = False

    def _push(self, data: bytes) -> None:
        if data:
            self._body.append(data)
            self._queued += len(data)
            if self._queued > HIGH_WATER and not self._paused and self._conn.transport is not None:
                self._paused = True
                self._conn.transport.pause_reading()
            self._wake()

    def _finish(self) -> None:
        self.done = True
        self._wake()

    # ---------------------------------------------------------------- read by the proxy
    async def wait_head(self) -> None:
        await self._head_done

    async def readany(self) -> bytes:
        """Body bytes as they arrived (all that is waiting), or b"" at the end."""
        while not self._body:
            if self._exc is not None:
                raise self._exc
            if self.done:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out = self._body.popleft() if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._queued = 0
        if self._paused and self._conn.transport is not None:
            self._paused = False
            self._conn.transport.resume_reading()
        return out

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the response: its connection goes back to the pool when it was read to its
        end and may be reused, else it closes."""
        conn, self._conn.response = self._conn, None
        if self.done and self._keep and not self._body and not conn.closed:
            self._pool.put(conn)
        else:
            conn.close()

    def close(self) -> None:
        self._conn.response = None
        self._conn.close()


class UpstreamClient:
    def __init__(self, idle_s: float = IDLE_S) -> None:
        self._idle: dict[Origin, deque[_Conn]] = {}
        self._idle_s = idle_s
        self._ssl: ssl.SSLContext | None = None
        self.opened = 0  # connections opened (a test reads it to see reuse)

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

    async def post(
        self, url: str, body: bytes, headers: CIMultiDict[str], connect_timeout_s: float | None
    ) -> UpstreamResponse:
        """POST ``body`` to ``url`` (``http(s)://host:port/path?query``); returns once the
        response's status and headers arrived. ``headers`` must not hold Host, Content-Length,
        Transfer-Encoding or Connection (``filter_headers`` with ``DROP_REQUEST`` drops them)."""
        parts = urlsplit(url)
        origin = origin_of(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"POST {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Length: {len(body)}\r\n"]
        lines.extend(f"{k}: {v}\r\n" for k, v in headers.items())
        lines.append("\r\n")
        head = "".join(lines).encode("latin-1")
        conn = self._take(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, head, body)
            except Disconnected as exc:
                if exc.answered:
                    raise
                # a pooled connection the replica closed (idle timeout, restart) as the request
                # went out, before any byte of an answer: the pool's others are suspect too
                for stale in self._idle.pop(origin, ()):
                    stale.close()
        return await self._exchange(await self._connect(origin, connect_timeout_s), head, body)

    async def _exchange(self, conn: _Conn, head: bytes, body: bytes) -> UpstreamResponse:
        resp = UpstreamResponse(conn, self)
        conn.response = resp
        try:
            assert conn.transport is not None
            conn.transport.writelines((head, body))
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
