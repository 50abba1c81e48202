"""Byte budgets of what clients can fill in the featurizer, and the metrics of bytes held
(docs/architecture.md, "Request path": features; every cache and buffer is bounded in bytes).

What a client's text can make the gateway hold, and its bound:

- the segment cache (``proxy.tokenize_cache_bytes``): each entry's text and token ids;
- the record of texts seen (``proxy.tokenize_seen_entries`` x ``SEEN_ENTRY_BYTES``: fixed-size
  fingerprints, so an entry bound is a byte bound);
- the deferred backlog (``proxy.tokenize_defer_backlog_bytes``): texts waiting to be encoded;
- the prefix checkpoints (``proxy.tokenize_checkpoint_bytes``): token ids of texts' blocks;
- encodes in flight (``proxy.tokenize_inflight_bytes``): texts on worker threads at once. An
  encode takes about 100 times its text's size in transient memory (measured with
  ``tokenizers`` 0.x on a 3 MB text: ~300 MB), so this bound and the per-request cap
  (``proxy.max_prompt_chars``) bound the peak, and ``release_memory`` hands that memory back to
  the system after a large encode (glibc keeps freed memory of worker threads' arenas otherwise:
  RSS grew by 1 GB over 30 distinct 3 MB prompts without it).

``text_bytes`` is what a ``str`` occupies (1, 2 or 4 bytes a character plus its header), read in
O(1) from ``sys.getsizeof``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SEEN_ENTRY_BYTES = 80  # a fingerprint of the seen-text record's capacity: dict slots + int objects, at peak
SEGMENT_ENTRY_OVERHEAD = (
    240  # one segment cache entry beyond its text and ids: key tuple, array header, LRU node
)
TRIM_AFTER_CHARS = 256 * 1024  # encodes at least this long give their transient memory back
TRIM_INTERVAL_S = 0.5  # at most this often (malloc_trim walks the heap)


@dataclass(frozen=True, slots=True)
class Budgets:
    """The featurizer's byte bounds (``proxy.tokenize_<name>`` or ``proxy.<name>``: read by
    ``featurizer.encode_settings``; None: unbounded)."""

    cache_bytes: int | None = None
    defer_backlog_bytes: int | None = None
    inflight_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int | None = None
    memo_cache_bytes: int = 32 * 1024 * 1024
    checkpoint_bytes: int = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EncodeSettings:
    """The featurizer's counts and thresholds (``proxy.tokenize_<name>``: read by
    ``featurizer.encode_settings``)."""

    cache_entries: int  # segment cache entries
    threads: int = 2  # worker threads for long encodes
    offload_chars: int = 16384  # uncached characters from which an encode leaves the event loop
    defer_chars: int = 0  # uncached new characters from which encoding waits for routing (0: never)
    seen_entries: int = 262144  # texts remembered as seen (they are encoded before routing)
    defer_backlog_chars: int = 4_000_000  # characters waiting to be encoded after routing
    # a whole job waits for arrivals to pause this long, and is not encoded once it has waited
    # the second (``DeferredEncodes``' lull; 0: starts at once)
    defer_quiet_s: float = 0.0
    defer_max_wait_s: float = 0.0
    budgets: Budgets = Budgets()


@dataclass(frozen=True, slots=True)
class DeferredLimits:
    """The bounds of the deferred encodes' backlog, and the lull before each whole job
    (``deferred.py:DeferredEncodes``, module docstring): ``proxy.tokenize_defer_*``."""

    backlog_chars: int  # characters waiting to be encoded; beyond it the oldest jobs are dropped
    backlog_bytes: int | None = None  # the same in bytes of text as held (None: characters only)
    quiet_s: float = 0.0  # a whole job waits until no request has arrived for this long (0: no wait)
    max_wait_s: float = 0.0  # ... and is not encoded once it has waited this long without one

    def __post_init__(self) -> None:
        non_negative(backlog_chars=self.backlog_chars, backlog_bytes=self.backlog_bytes)
        if self.quiet_s < 0 or self.max_wait_s < 0:
            raise ValueError("quiet_s and max_wait_s must be >= 0")


def non_negative(**bounds: int | None) -> None:
    """Raise ``ValueError`` naming the first bound below zero (None: unbounded, accepted)."""
    for name, value in bounds.items():
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0")


def text_bytes(text: str) -> int:
    """The bytes ``text`` occupies in memory."""
    return sys.getsizeof(text)


class ByteBudget:
    """An asyncio semaphore counted in bytes: ``acquire(n)`` waits until ``n`` more bytes fit
    under ``limit``, or until nothing is held (a single holder larger than the limit runs alone,
    never forever refused); ``release(n)`` never waits. Event loop thread only. Invariant:
    ``held <= limit`` unless one holder holds it all."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("limit must be > 0")
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._waiters: list[asyncio.Future[None]] = []

    def try_acquire(self, n: int) -> bool:
        """``acquire`` when it would not wait (True); else nothing changes (False)."""
        if self.held and self.held + n > self.limit:
            return False
        self.held += n
        self.peak = max(self.peak, self.held)
        return True

    async def acquire(self, n: int) -> None:
        while self.held and self.held + n > self.limit:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut  # woken by a release, then checks again
        self.held += n
        self.peak = max(self.peak, self.held)
        assert self.held <= self.limit or self.held == n

    def release(self, n: int) -> None:
        self.held -= n
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    @contextlib.asynccontextmanager
    async def hold(self, n: int) -> AsyncIterator[None]:
        await self.acquire(n)
        try:
            yield
        finally:
            self.release(n)


class MemoryReleaser:
    """``malloc_trim(0)`` after a large encode, at most every ``TRIM_INTERVAL_S`` (any thread).
    A no-op where libc has no ``malloc_trim`` (not glibc)."""

    def __init__(self) -> None:
        self._trim: Callable[[int], int] | None = None
        with contextlib.suppress(OSError, AttributeError):
            self._trim = ctypes.CDLL(None).malloc_trim
        self._lock = threading.Lock()
        self._last = 0.0
        self.trims = 0

    def after_encode(self, chars: int) -> None:
        if self._trim is None or chars < TRIM_AFTER_CHARS:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._last < TRIM_INTERVAL_S:
                return
            self._last = now
            self.trims += 1
        self._trim(0)


class MemoryCollector(Collector):
    """``kvgate_memory_bytes{holder}`` and ``kvgate_memory_budget_bytes{holder}`` of the featurizer
    in use, read at scrape time from ``stats`` (``Featurizer.memory_stats``: holder -> (held,
    budget))."""

    def __init__(self, stats: Callable[[], Mapping[str, tuple[int, int]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            "kvgate_memory_bytes", "Bytes held by a cache or buffer clients fill.", labels=["holder"]
        )
        budget = GaugeMetricFamily(
            "kvgate_memory_budget_bytes", "Configured bound of that cache or buffer.", labels=["holder"]
        )
        for holder, (h, b) in sorted(self._stats().items()):
            held.add_metric([holder], h)
            budget.add_metric([holder], b)
        yield held
        yield budget
