"""The first-byte wait of attempts (docs/architecture.md, "Request path"): how long an attempt
may wait for its replica's first byte, and the failover of attempts whose replica is ejected
while they wait.

``EjectionWatch`` is one task, running while attempts wait, that checks their replicas' health
every ``WATCH_INTERVAL_S`` and expires their waits: at their deadline, or at once when their
replica was ejected and another could take the request. A wait is an ``asyncio.Timeout`` with no
timer of its own (an expiry reschedules it to now, which cancels the waiting task and raises
``TimeoutError`` at the block's end, as ``asyncio.timeout`` does), so a request arms and disarms
no timer: the watch wakes at the earliest deadline or the next health check, whichever is first.
A wait shorter than ``WATCH_INTERVAL_S`` keeps a timer of its own (the watch, asleep for up to
that long, could wake after its deadline). Event-loop thread only.

Invariants: a wait is in ``EjectionWatch`` exactly while its block runs; it is expired at most
once; the watch task runs while a wait is registered.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from gateway.replica_record import ReplicaRecord

WATCH_INTERVAL_S = 0.2  # how soon an attempt on an ejected replica is failed over


@dataclass(slots=True, eq=False)  # identity-hashed: one per attempt
class FirstByteWait:
    """One attempt waiting for its first byte: its replica, its deadline (loop time), whether it
    was ejected. ``async with`` it around the wait (``EjectionWatch.first_byte``)."""

    watch: EjectionWatch
    record: ReplicaRecord
    timeout_s: float
    others: Callable[[], bool]  # whether another healthy replica could take the request
    ejected: bool = False
    expired: bool = False  # by the watch, once (a Timeout expiring already cannot be rescheduled)
    deadline: float = math.inf  # checked by the watch (inf: the wait's own timer)
    timeout: asyncio.Timeout = field(init=False)

    async def __aenter__(self) -> FirstByteWait:
        loop = asyncio.get_running_loop()
        if self.timeout_s < WATCH_INTERVAL_S:
            self.timeout = asyncio.timeout(self.timeout_s)
        else:
            self.timeout = asyncio.timeout(None)
            self.deadline = loop.time() + self.timeout_s
        await self.timeout.__aenter__()
        self.watch.add(self)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.watch.discard(self)
        await self.timeout.__aexit__(et, exc, tb)  # raises TimeoutError for an expired wait

    def expire(self, now: float) -> None:
        self.expired = True
        if self.timeout.expired():  # its own timer fired first
            return
        self.timeout.reschedule(now)


class EjectionWatch:
    """Ends the first-byte wait of attempts past their deadline or whose replica became
    unhealthy (event loop only)."""

    def __init__(self) -> None:
        self._waiting: set[FirstByteWait] = set()
        self._task: asyncio.Task[None] | None = None

    def first_byte(self, rec: ReplicaRecord, timeout_s: float, others: Callable[[], bool]) -> FirstByteWait:
        """``async with`` this: like ``asyncio.timeout(timeout_s)``, also expiring at once when
        ``rec`` is ejected while ``others()`` says another replica could take the request (the
        block then raises ``TimeoutError``); with no other replica, the attempt keeps waiting for
        its own."""
        return FirstByteWait(self, rec, timeout_s, others)

    def add(self, wait: FirstByteWait) -> None:
        self._waiting.add(wait)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-ejection-watch")

    def discard(self, wait: FirstByteWait) -> None:
        self._waiting.discard(wait)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            wake = loop.time() + WATCH_INTERVAL_S
            while self._waiting:
                # a wait added while asleep has a deadline at least WATCH_INTERVAL_S after it was
                # added, so not before this wake: it is seen in time
                await asyncio.sleep(max(0.0, wake - loop.time()))
                now = loop.time()
                wake = now + WATCH_INTERVAL_S
                for wait in list(self._waiting):
                    if wait.expired:
                        continue  # its block ends at the loop's next turn
                    if now >= wait.deadline:
                        wait.expire(now)
                    elif not wait.record.healthy and wait.others():
                        wait.ejected = not wait.timeout.expired()  # else it timed out first
                        wait.expire(now)
                    else:
                        wake = min(wake, wait.deadline)
        finally:
            self._task = None
