"""How a streamed answer's body goes from its replica to the client after its first bytes
(docs/architecture.md, "Request path", step 8): the relays, and their idle watchdog (a stream with
no byte from its replica for ``proxy.stream_idle_timeout_s`` is cut).

``DirectRelay`` (a client taking HTTP/1.1 chunks as they come, i.e. almost every client) writes
each read of the replica's body to the client from the replica connection's callback; the relay
task sleeps until the body ends. ``ChunkRelay`` (any other client: HTTP/1.0, a compressed
response) reads and writes chunk by chunk in the task.

A relayed SSE stream used to enter an ``asyncio.timeout`` around every upstream read: a timer
created, pushed on the loop's heap and cancelled per chunk, a few microseconds each, for a limit
that is almost never reached. ``IdleWatch`` is one timer per stream, re-armed lazily: the relay
only stores in ``since`` the loop time at which it starts waiting for the replica, and sets it
back to ``inf`` when it stops (a read returned; the direct relay waits from each piece written
until a slow client is drained); when the timer fires it re-arms itself for the deadline of
the wait in progress (or a full period when the relay is not waiting, e.g. writing to a slow
client), and only when a wait has lasted the whole limit does it fail the upstream reader with
``TimeoutError``: the read in progress raises it, as aiohttp's own read timeouts do.

Invariants: at most one timer is scheduled per watch; ``close`` cancels it (the relay calls it in a
``finally``); a watch never fails a reader the relay is not waiting on.
"""

from __future__ import annotations

import asyncio
import math
from typing import Protocol

from aiohttp import web


class RelayResponse(web.StreamResponse):
    """A streamed answer whose headers go out with its first bytes, in one write. aiohttp's
    ``StreamResponse`` writes them at ``prepare``, on their own: a second write, and a client
    woken for headers before the bytes it waits for (its ``Response`` buffers them like this).
    The relays rely on it: the headers are on the wire once the first bytes are written."""

    _send_headers_immediately = False


class Reader(Protocol):
    """What the watch fails: the upstream response's body reader (gateway/upstream_response.py)."""

    def set_exception(self, exc: BaseException) -> None: ...


class IdleWatch:
    """One stream's idle timeout over its upstream reads (module docstring)."""

    __slots__ = ("_handle", "_idle_s", "_loop", "_reader", "since")

    def __init__(self, reader: Reader, idle_s: float) -> None:
        assert idle_s > 0
        loop = asyncio.get_running_loop()
        self._loop, self._idle_s, self._reader = loop, idle_s, reader
        # loop time at which the relay started waiting for the replica; inf: not waiting
        self.since = math.inf
        self._handle: asyncio.TimerHandle | None = loop.call_at(loop.time() + idle_s, self._fire)

    def _fire(self) -> None:
        now = self._loop.time()
        due = self.since + self._idle_s
        if due <= now:
            self._handle = None
            self._reader.set_exception(TimeoutError(f"no byte for {self._idle_s:g}s"))
            return
        # the wait in progress ends at ``due``; no wait: a full period from now
        self._handle = self._loop.call_at(min(due, now + self._idle_s), self._fire)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class Tail(Protocol):
    """Where a relay keeps the stream's last bytes for the audit (gateway/prediction_audit.py)."""

    def feed(self, chunk: bytes) -> None: ...


class Body(Protocol):
    """The replica's response body as the relays read it (gateway/upstream_response.py)."""

    async def readany(self) -> bytes: ...

    def relay(self, sink: DirectRelay) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class Writer(Protocol):
    """aiohttp's payload writer, as the relays use it."""

    async def write(self, chunk: bytes) -> None: ...

    async def drain(self) -> None: ...


class ClientGone(Exception):
    """The client's connection closed under the relay (not the replica's fault)."""


CLIENT_HIGH_WATER = 64 * 1024  # client bytes buffered beyond which the replica's reading pauses


class ChunkRelay:
    """The rest of a streamed body passed on chunk by chunk by the relay task: each read from the
    replica, then written through aiohttp's writer (a client whose response is not chunked as it
    comes: HTTP/1.0, or compressed)."""

    __slots__ = ("_tail", "_up", "_watch", "_writer", "sent")

    def __init__(self, up: Body, writer: Writer, watch: IdleWatch, tail: Tail | None) -> None:
        self._up, self._writer, self._watch, self._tail = up, writer, watch, tail
        self.sent = 0  # body bytes written to the client

    async def run(self) -> None:
        """Until the body has ended; raises why it ended early (the replica's error, ``TimeoutError``
        from the idle watch, ``ClientGone``)."""
        read, write, watch = self._up.readany, self._writer.write, self._watch
        now = asyncio.get_running_loop().time
        while True:
            watch.since = now()
            chunk = await read()
            watch.since = math.inf
            if not chunk:
                return
            if self._tail is not None:
                self._tail.feed(chunk)
            try:
                await write(chunk)
            except ConnectionResetError:  # aiohttp's ClientConnectionResetError too
                raise ClientGone("client disconnected") from None
            self.sent += len(chunk)


class DirectRelay:
    """The rest of a streamed body written to the client from the replica connection's callback.

    ``ChunkRelay``'s task wakes once per chunk: the de-framed piece queued, a future resolved, the
    task resumed to read it and hand it to aiohttp's writer. Here ``UpstreamResponse`` calls
    ``piece`` for each de-framed piece as it arrives, which re-frames it as one HTTP/1.1 chunk on
    the client's transport, keeps the SSE tail for the audit and notes the time for the idle
    watch; the task (``run``) sleeps until the body ends, and wakes only to drain a slow client.

    Used after the first bytes went out through aiohttp's writer (which sent the headers with
    them), and only when that writer frames chunks as they come (``over``), so the bytes on the
    wire are those aiohttp would write.

    Invariants: ``end`` takes effect once; after it ``piece`` writes nothing; while the client's
    transport holds more than ``CLIENT_HIGH_WATER`` bytes the replica's reading is paused (the
    pieces of at most one more read are buffered), and ``run`` resumes it once the client drained;
    when ``run`` returns or raises, the relay has ended and the replica's reading is not paused.
    """

    __slots__ = (
        "_client",
        "_drain",
        "_now",
        "_signal",
        "_tail",
        "_up",
        "_watch",
        "ended",
        "exc",
        "paused",
        "sent",
    )

    def __init__(
        self, client: asyncio.Transport, up: Body, writer: Writer, watch: IdleWatch, tail: Tail | None
    ) -> None:
        loop = asyncio.get_running_loop()
        self._client, self._up, self._drain, self._watch, self._tail = client, up, writer.drain, watch, tail
        self._now = loop.time
        self._signal: asyncio.Future[None] = loop.create_future()
        self.sent = 0  # body bytes written to the client
        self.paused = False
        self.ended = False
        self.exc: BaseException | None = None  # why the body ended early (None: it was complete)

    @classmethod
    def over(cls, writer: Writer, up: Body, watch: IdleWatch, tail: Tail | None) -> DirectRelay | None:
        """A direct relay when ``writer`` (aiohttp's payload writer, headers sent) frames HTTP/1.1
        chunks as they come (chunked, not compressed, no declared length), else None."""
        client = getattr(writer, "transport", None)
        if (
            client is None
            or getattr(writer, "chunked", False) is not True
            or getattr(writer, "_compress", True) is not None
            or getattr(writer, "length", 0) is not None
        ):
            return None
        return cls(client, up, writer, watch, tail)

    def piece(self, data: bytes) -> None:
        if self.ended:
            return
        client = self._client
        if client.is_closing():
            self.end(ClientGone("client disconnected"))
            return
        client.write(b"%x\r\n%b\r\n" % (len(data), data))
        self.sent += len(data)
        if self._tail is not None:
            self._tail.feed(data)
        self._watch.since = self._now()  # the wait for the replica's next byte starts now
        if not self.paused and client.get_write_buffer_size() > CLIENT_HIGH_WATER:
            self.paused = True
            self._up.pause_reading()
            self._wake()

    def end(self, exc: BaseException | None) -> None:
        if not self.ended:
            self.ended, self.exc = True, exc
            self._wake()

    def _wake(self) -> None:
        if not self._signal.done():
            self._signal.set_result(None)

    async def run(self) -> None:
        """Until the body has ended; raises why it ended early (the replica's error, ``TimeoutError``
        from the idle watch, ``ClientGone``)."""
        self._watch.since = self._now()
        self._up.relay(self)
        try:
            while True:
                await self._signal
                self._signal = asyncio.get_running_loop().create_future()
                if self.ended:
                    if self.exc is not None:
                        raise self.exc
                    return
                if self.paused:  # the client is slow: wait for it, not for the replica
                    self._watch.since = math.inf
                    try:
                        await self._drain()
                    except ConnectionResetError:  # aiohttp's ClientConnectionResetError too
                        raise ClientGone("client disconnected") from None
                    self._watch.since = self._now()
                    self._resume()
        finally:
            # however the relay ends (the body's end, an error, the task cancelled): nothing more
            # is written, and the replica's connection reads again (a body read to its end while
            # paused goes back to the pool, where a paused connection would never answer)
            self.end(None)
            self._resume()

    def _resume(self) -> None:
        if self.paused:
            self.paused = False
            self._up.resume_reading()
