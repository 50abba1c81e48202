"""Where encodes run (docs/architecture.md, "Request path": features): the request path's worker
threads for long encodes, and one background thread at the lowest CPU priority for deferred ones.

``tokenizers`` releases the GIL in ``encode_batch`` (not in ``encode``, which holds it for the
whole encode: off the event loop's thread the segment encoder calls ``encode_batch`` only,
``encode_calls``), so an encode on a worker thread leaves the event loop free. At most ``4 x threads`` encodes are handed to the pool at once
(``offload_bound``), and at most ``inflight_bytes`` of text (``ByteBudget``); beyond that
requests wait their turn, so a burst of long prompts cannot queue unbounded work nor unbounded
transient memory. A large encode gives its transient memory back (``MemoryReleaser``). Both pools
start on first use; ``close`` shuts them, waiting for running encodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import platform
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gateway.features.budgets import ByteBudget, MemoryReleaser

T = TypeVar("T")

BACKGROUND_THREAD_NAME = b"kvgate-deferred"  # the OS thread name (``/proc/PID/task/*/comm``)
BACKGROUND_NICE = 19
# Linux's EEVDF scheduler lets the task on a CPU keep it until it has run its slice (1.4 ms on a
# 2-CPU host by default) before a task that wakes up there takes it, whatever their niceness.
# The deferred encoder is always runnable under new text, so without a slice of its own the event
# loop, the replicas' answers and co-located engines waited behind it for up to that long: the
# unloaded p99 of new chats (docs/performance.md, "The deferred encoder's slice"). The smallest
# custom slice Linux takes (``sched_attr.sched_runtime`` for SCHED_OTHER, Linux >= 6.12; older
# kernels ignore it) bounds that wait to 0.1 ms.
BACKGROUND_SLICE_NS = 100_000
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}  # syscall numbers (glibc has no wrapper)


def _sched_attr(nice: int, slice_ns: int) -> bytes:
    """``struct sched_attr`` (its first version, 48 bytes): SCHED_OTHER at ``nice``, with
    ``slice_ns`` as its slice."""
    return struct.pack("=IIQiIQQQ", 48, 0, 0, nice, 0, slice_ns, 0, 0)


def _lower_thread_priority() -> None:
    """Nice 19 and a 0.1 ms slice for the calling thread (``sched_setattr``); where that call is
    missing or refused, nice 19 only."""
    number = _SCHED_SETATTR.get(platform.machine())
    if number is not None:
        with contextlib.suppress(AttributeError, OSError):  # not Linux
            attr = ctypes.create_string_buffer(_sched_attr(BACKGROUND_NICE, BACKGROUND_SLICE_NS))
            if ctypes.CDLL(None, use_errno=True).syscall(number, 0, attr, 0) == 0:
                return
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def mark_background_thread() -> None:
    """Give the calling thread the lowest scheduling priority (Linux: per-thread nice 19, a 0.1 ms
    slice) and an OS-visible name, so that tools (``top -H``, the overhead benchmark) can tell its
    CPU apart."""
    _lower_thread_priority()
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).prctl(15, BACKGROUND_THREAD_NAME, 0, 0, 0)  # PR_SET_NAME


class EncodeExecutor:
    def __init__(self, threads: int, offload_chars: int, inflight_bytes: int = 4 * 1024 * 1024) -> None:
        self.threads = threads
        self.offload_chars = offload_chars  # encodes of at least this many characters leave the loop
        self._executor: ThreadPoolExecutor | None = None
        self._background: ThreadPoolExecutor | None = None
        # at most 4 encodes queued per thread: beyond that requests wait their turn here
        self.offload_bound = threads * 4
        self._slots = asyncio.Semaphore(self.offload_bound) if threads > 0 else None
        self.offload_queued = 0  # encodes handed to the pool and not finished (<= offload_bound)
        self.offload_queued_max = 0
        self.inflight = ByteBudget(inflight_bytes)
        self.releaser = MemoryReleaser()

    def releasing(self, chars: int, encode: Callable[[], T]) -> Callable[[], T]:
        """``encode`` followed, on the same thread, by giving a large encode's memory back."""

        def run() -> T:
            try:
                return encode()
            finally:
                self.releaser.after_encode(chars)

        return run

    def pool(self) -> ThreadPoolExecutor | None:
        """The request path's worker threads, started on first use (None when configured with
        none: encodes then run on the event loop)."""
        if self._executor is None and self.threads > 0:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="kvgate-tokenize")
        return self._executor

    def background_pool(self) -> ThreadPoolExecutor:
        """One worker thread at the lowest CPU priority for deferred encodes: they are work for a
        later request, so they yield the CPU to requests being routed and to co-located engines."""
        if self._background is None:
            self._background = ThreadPoolExecutor(
                1, thread_name_prefix="kvgate-deferred", initializer=mark_background_thread
            )
        return self._background

    def offloads(self, chars: int) -> bool:
        """Whether an encode of ``chars`` characters runs on a worker thread."""
        return chars >= self.offload_chars and self._slots is not None

    async def run(self, chars: int, encode: Callable[[], T], nbytes: int | None = None) -> tuple[T, bool]:
        """``encode()``'s result, on a worker thread when ``chars`` is long enough (True), else
        on the calling thread (False). ``nbytes``: the text's size (default: ``chars``), held
        against ``inflight_bytes`` while it is encoded on a thread."""
        if not self.offloads(chars):
            return encode(), False
        assert self._slots is not None
        encode = self.releasing(chars, encode)
        async with self.inflight.hold(chars if nbytes is None else nbytes), self._slots:
            pool = self.pool()
            assert pool is not None
            self.offload_queued += 1
            self.offload_queued_max = max(self.offload_queued_max, self.offload_queued)
            try:
                return await asyncio.get_running_loop().run_in_executor(pool, encode), True
            finally:
                self.offload_queued -= 1

    async def close(self) -> None:
        """Shut the background thread, then the workers (each waits for its running encode)."""
        loop = asyncio.get_running_loop()
        if self._background is not None:
            background, self._background = self._background, None
            await loop.run_in_executor(None, background.shutdown)
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await loop.run_in_executor(None, executor.shutdown)
