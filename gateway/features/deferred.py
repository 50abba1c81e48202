"""Encoding new prompt text after the request was routed (ARCHITECTURE.md §10: tokenization is
the largest cost on the request path).

The featurizer routes a request whose trailing text is new on its cached prefix and hands the
new segments here; they are encoded on a worker thread (``tokenizers`` releases the GIL in
``encode_batch``) and put in the segment cache, so that the next turn of the conversation, which
repeats them, finds them encoded. The backlog is bounded in characters: when requests bring new
text faster than it can be encoded, the oldest waiting jobs are dropped (their text is encoded on
the request path if it ever comes back); a job only holds the segments it encodes. Owned by the ``Featurizer``; ``close`` cancels the worker before the
featurizer's threads shut down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from gateway.features.segment_encoder import EncodePlan, SegmentEncoder

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Job:
    encoder: SegmentEncoder
    plan: EncodePlan  # only the segments to encode
    chars: int


class DeferredEncodes:
    def __init__(self, backlog_chars: int, executor: Callable[[], Executor | None]) -> None:
        """``executor`` returns the pool to encode on, or None to encode on the event loop."""
        if backlog_chars < 0:
            raise ValueError("backlog_chars must be >= 0")
        self.backlog_chars = backlog_chars
        self.queued_chars = 0
        self._executor = executor
        self._jobs: deque[_Job] = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while nothing is queued or being encoded
        self._idle.set()
        self._worker: asyncio.Task[None] | None = None
        self.submitted = 0
        self.encoded = 0  # jobs finished (segments now cached)
        self.dropped = 0  # jobs dropped from a full backlog
        self.failed = 0  # jobs whose encode raised (a bug; logged)

    def __len__(self) -> int:
        return len(self._jobs)

    def submit(self, encoder: SegmentEncoder, plan: EncodePlan) -> None:
        """Queue ``plan``'s missing segments (event loop thread; never blocks)."""
        self.submitted += 1
        keys = [plan.keys[i] for i in plan.missing]
        job = _Job(
            encoder,
            EncodePlan(keys=keys, found=[None] * len(keys), separators=[], missing=list(range(len(keys)))),
            plan.missing_chars,
        )
        if job.chars > self.backlog_chars:
            self.dropped += 1
            return
        while self.queued_chars + job.chars > self.backlog_chars:
            self.queued_chars -= self._jobs.popleft().chars
            self.dropped += 1
        self._jobs.append(job)
        self.queued_chars += job.chars
        self._idle.clear()
        self._wake.set()
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="kvgate-deferred-encode")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._jobs:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            job = self._jobs.popleft()
            self.queued_chars -= job.chars
            enc, plan = job.encoder, job.encoder.still_missing(job.plan)
            try:
                if plan.missing:
                    pool = self._executor()
                    if pool is None:
                        done = enc.encode_missing(plan, add_special_tokens=False)
                    else:
                        done = await loop.run_in_executor(
                            pool, functools.partial(enc.encode_missing, plan, add_special_tokens=False)
                        )
                    enc.remember(plan, done)
                self.encoded += 1
            except Exception:  # one bad job must not stop the worker
                self.failed += 1
                log.exception("deferred encode failed")

    async def drain(self) -> None:
        """Until every queued job is done."""
        await self._idle.wait()

    async def close(self) -> None:
        """Cancel the worker; queued jobs are discarded."""
        self._jobs.clear()
        self.queued_chars = 0
        self._idle.set()
        if self._worker is not None:
            worker, self._worker = self._worker, None
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
