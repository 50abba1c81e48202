"""The stream relay's idle watchdog (docs/architecture.md, "Request path": a stream with no byte
from its replica for ``proxy.stream_idle_timeout_s`` is cut).

A relayed SSE stream used to enter an ``asyncio.timeout`` around every upstream read: a timer
created, pushed on the loop's heap and cancelled per chunk, a few microseconds each, for a limit
that is almost never reached. ``IdleWatch`` is one timer per stream, re-armed lazily: the relay
only stores in ``since`` the loop time at which it starts waiting for the replica, and sets it
back to ``inf`` when the read returns; when the timer fires it re-arms itself for the deadline of
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
