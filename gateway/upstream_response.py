"""One upstream response as it arrives (gateway/upstream_client.py has the client, its
invariants and why): the status line and headers, then the body de-framed (Content-Length,
chunked, or until the connection closes) into a queue the proxy reads with ``readany``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Protocol

from multidict import CIMultiDict

from gateway.upstream_errors import BadResponse, Disconnected

if TYPE_CHECKING:
    from gateway.upstream_client import UpstreamClient, _Conn

MAX_HEAD = 64 * 1024
MAX_CHUNK_LINE = 4096
HIGH_WATER = 1024 * 1024  # body bytes waiting to be read beyond which reading pauses


class Sink(Protocol):
    """Where ``UpstreamResponse.relay`` sends the body (gateway/stream_relay.py: DirectRelay)."""

    def piece(self, data: bytes) -> None: ...

    def end(self, exc: BaseException | None) -> None: ...


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
        self._sink: Sink | None = None  # set by ``relay``: pieces go there, not to the queue

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
            return
        if self._sink is not None:
            self._to_sink(self._sink)

    def lost(self, exc: Exception | None) -> None:
        self._keep = False
        if self._mode == "eof" and self._head_done.done() and not self.done:
            self._finish()
            return
        if not self.done:
            answered = self._head_done.done() or bool(self._buf)
            self._fail(Disconnected(f"replica closed the connection{f': {exc}' if exc else ''}", answered))

    def set_exception(self, exc: BaseException) -> None:
        """Fail the read in progress, and every later one, with ``exc`` (the stream relay's idle
        watch: gateway/stream_relay.py)."""
        self._keep = False
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None:
            self._exc = exc
        if not self._head_done.done():
            self._head_done.set_exception(exc)
            self._head_done.exception()  # retrieved: the caller may be gone
        self._wake()

    def _wake(self) -> None:
        if self._sink is not None:
            self._to_sink(self._sink)
            return
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
        if 100 <= int(code) < 200:  # an interim answer (100 Continue, 103 Early Hints): skipped
            self._buf = bytearray(rest)
            self._head()
            return
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
        if self.status in (204, 304):
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
            if self._sink is not None:
                return  # passed on as one piece when the read is done (``feed``)
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

    def relay(self, sink: Sink) -> None:
        """From now on each body piece goes to ``sink.piece`` as it arrives, from the connection's
        callback, not to the queue ``readany`` reads (what is queued goes first); ``sink.end`` is
        called when the body ends (None) or fails (the error ``readany`` would raise)."""
        assert self._sink is None and self._waiter is None
        self._sink = sink
        self._to_sink(sink)  # ends the sink at once when the body already ended
        if self._paused:  # the queue's pause is over (also for a body already read to its end)
            self._paused = False
            self.resume_reading()

    def _to_sink(self, sink: Sink) -> None:
        """What has arrived, as one piece (one write to the client for one read from the replica),
        then the end of the body when it has come."""
        if self._body:
            data = self._body.popleft() if len(self._body) == 1 else b"".join(self._body)
            self._body.clear()
            self._queued = 0
            sink.piece(data)
        if self._exc is not None or self.done:
            sink.end(self._exc)

    def pause_reading(self) -> None:
        if self._conn.transport is not None:
            self._conn.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._conn.transport is not None:
            self._conn.transport.resume_reading()

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
