"""Encoding new prompt text after the request was routed (docs/architecture.md, "Request path":
features; tokenization is the largest cost on the request path).

The featurizer routes a request whose trailing text is new on its cached prefix and hands its
text here as a ``DeferredJob``. The job is encoded on a worker thread (``tokenizers`` releases
the GIL in ``encode_batch``), its new segments go into the segment cache, where the
conversation's next turn finds them, and, once the proxy has committed an attempt (``on_keys``
is then ``Router.record`` of that attempt), the whole prompt's keys become that replica's
speculative index entries through the router's one writer, as an encoded-first request's would
have.

A request carrying the same new text while the first one's job is still waiting (a burst of
requests on one new document) takes the job over (``expedite``): it is encoded at once, on the
request path's pool rather than the background thread (whose lowest priority the waiting
request would otherwise inherit), and its entries are recorded before the second request is
matched, so the burst finds the first request's replica instead of scattering the document's
prefill over the fleet. When the two share only the job's leading segments (a new system prompt,
each request with its own message), only those are encoded then: their keys become the first
request's entries through ``on_prefix``, and the rest of the job stays queued. The second
request waits for the text it shares, not for the first one's own message (1.3-1.9 ms against
3.4-4.5 for a whole 8 KB job; docs/performance.md, "The unloaded tail of new chats").

Heads first: the worker encodes the leading new segments of every queued job (``EncodePlan.head``:
all its new segments but the last) before any job's remaining text, oldest first. A prompt's
blocks are keyed in a chain, so its later text cannot be matched before its head is, and the head
is the part other requests share (a new system prompt reaches many conversations within
milliseconds; a job's last segment, the newest message, is shared only by its own conversation's
next turn, seconds later). When jobs queue faster than the thread encodes them, a request sharing
a queued job's head then finds it cached and keyed, on the first request's replica (``on_prefix``),
instead of taking the encode over on its own path. The job next in line is encoded whole, so with
nothing queued behind it nothing changes.

A lull before each whole job (``quiet_s``, ``max_wait_s``): the worker starts a job's remaining
text only once no request has arrived for ``quiet_s`` (``arrival``, called by the featurizer for
every request). Requests come in bursts (Mooncake's traces: up to 16 prompts within ~20 ms), and
every request of a burst brings its own new text; an encode started then takes a core from the
burst's own requests and from the engines serving them on a host the gateway shares, whatever its
niceness (the slice it was given runs out first), so the later requests of the burst waited for
it. After the burst the same encodes cost nothing on anyone's path. A request needing a queued
job's text meanwhile takes it over (``expedite``); heads are not held (other requests are about
to need them). A job that waited ``max_wait_s`` without a lull is not encoded (``expired``):
arrivals that never pause leave no idle time for text that may never come back (an encode then
lengthens every request's path); text that does is encoded on its request's path, as after a
drop from the backlog. Measured in docs/performance.md, "Background encodes wait for a lull" and
"Encodes no lull reaches".

The backlog is bounded in characters and in bytes (the texts as held): beyond it the oldest jobs
are dropped (``dropped``). Owned by the ``Featurizer``; ``close`` cancels the worker before the
featurizer's threads shut down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

from tokenizers import Encoding

from gateway.features.budgets import DeferredLimits
from gateway.features.deferred_job import DeferredJob
from gateway.features.novelty import PROBE_CHARS
from gateway.features.prefix_checkpoints import (
    Checkpoint,
    Known,
    PrefixCheckpoints,
    ResumedPiece,
    checkpoints_of,
    resume_missing,
)
from gateway.features.segment_encoder import EncodePlan, FirstPiece, TokenArray

log = logging.getLogger(__name__)

# One job in this many whose head was composed from prefix checkpoints encodes its text whole and
# checks that head (``PrefixCheckpoints.check``: a difference turns checkpoints off for good); the
# others resume after the checkpoints (exact by the context word's check, prefix_checkpoints.py).
# Counted per tokenizer, its first checked: one breaking the premise is caught at once, later within this many.
CHECK_EVERY = 16
_T = TypeVar("_T")


def _same_first(planned: EncodePlan, now: EncodePlan) -> bool:
    """Whether ``now`` (``planned`` less what was cached meanwhile) still encodes ``planned``'s
    first text to encode first (the text whose blocks the job's fingerprints are of)."""
    return planned.whole is not None or (bool(now.missing) and now.missing[0] == planned.missing[0])


class DeferredEncodes:
    def __init__(
        self,
        limits: DeferredLimits,
        executor: Callable[[], Executor | None],
        urgent_executor: Callable[[], Executor | None] | None = None,
        after_encode: Callable[[int], None] | None = None,
        checkpoints: PrefixCheckpoints | None = None,
    ) -> None:
        """``limits``: the backlog's bounds and the lull before a whole job (module docstring);
        ``executor`` returns the pool of the background encodes, ``urgent_executor`` the one of
        encodes a waiting request takes over (default: the same); None encodes on the event loop.
        ``after_encode(chars)`` runs on the encoding thread after each encode (memory release);
        ``checkpoints``: where a whole text's encode records the exact tokens of its blocks."""
        self.limits = limits
        self._last_arrival = -math.inf  # event-loop time of the latest request (``arrival``)
        self.queued_chars = self.queued_bytes = 0
        self._executor = executor
        self._after_encode = after_encode
        self.checkpoints = checkpoints
        self._urgent_executor = urgent_executor or executor
        self._jobs: deque[DeferredJob] = deque()
        self._pending: dict[int, DeferredJob] = {}  # by fingerprint, while queued or being encoded
        # Invariant: the queued jobs whose head (``EncodePlan.head``) no one has encoded or begun to
        # encode, by fingerprint, oldest first; each is in ``_jobs`` (so the backlog's bounds hold)
        self._heads: dict[int, DeferredJob] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while nothing is queued or being encoded
        self._idle.set()
        self._worker: asyncio.Task[None] | None = None
        self.submitted = 0
        self.encoded = 0  # jobs finished (segments cached, entries recorded)
        self.expedited = 0  # jobs taken over by a request carrying the same text
        self.expedited_heads = 0  # of which only the shared leading segments were encoded then
        self.heads_first = 0  # heads the worker encoded ahead of the queue (module docstring)
        self.lulls = 0  # times the worker waited for arrivals to pause before a job
        self.dropped = 0  # jobs dropped from a full backlog
        self.expired = 0  # jobs not encoded: no lull came within ``max_wait_s`` (module docstring)
        self.failed = 0  # jobs whose encode raised (a bug; logged)
        self.resumed = 0  # jobs encoded only after their head's checkpoints (``_resume_next``)
        # jobs routed on a head from checkpoints, per tokenizer (one per model: bounded by the
        # config), for ``_resume_next``
        self._from_checkpoints: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def arrival(self) -> None:
        """A request arrived (event loop thread): whole jobs wait for arrivals to pause."""
        self._last_arrival = asyncio.get_running_loop().time()

    def submit(self, job: DeferredJob) -> None:
        """Queue ``job`` (event loop thread; never blocks)."""
        self.submitted += 1
        job.queued_at = asyncio.get_running_loop().time()
        if not self._fits(job, 0, 0):
            self.dropped += 1
            job.end()  # never encoded, like a job dropped from the backlog (_forget)
            return
        while not self._fits(job, self.queued_chars, self.queued_bytes):
            self._forget(self._jobs.popleft())
            self.dropped += 1
        self._jobs.append(job)
        self._pending[job.fingerprint] = job
        if job.plan.whole is None and len(job.plan.missing) > 1:  # it has a head (EncodePlan.head)
            self._heads[job.fingerprint] = job
        self.queued_chars += job.chars
        self.queued_bytes += job.bytes
        self._idle.clear()
        self._wake.set()
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="kvgate-deferred-encode")

    def _fits(self, job: DeferredJob, chars: int, nbytes: int) -> bool:
        """Whether ``job`` fits in a backlog already holding ``chars`` and ``nbytes``."""
        lim = self.limits
        fits_bytes = lim.backlog_bytes is None or nbytes + job.bytes <= lim.backlog_bytes
        return chars + job.chars <= lim.backlog_chars and fits_bytes

    def pending(self, fingerprint: int) -> bool:
        return fingerprint in self._pending

    async def expedite(self, fingerprint: int, shared_chars: int | None = None) -> None:
        """Finish the job of ``fingerprint`` now: encode it here if it is still queued, or wait
        for the worker that is encoding it. ``shared_chars``: the caller shares only the job's
        text's first that many characters; when they end before its last segment to encode, only
        the segments there are encoded now and the job stays queued for the rest."""
        job = self._pending.get(fingerprint)
        if job is None:
            return
        self.expedited += 1
        if job.head_busy is not None:  # another request is encoding the head it shares
            await job.head_busy.wait()
            return
        enc = job.encoder
        head = (
            None if shared_chars is None else enc.still_missing(job.plan).leading(shared_chars, PROBE_CHARS)
        )
        if head is not None and job in self._jobs:
            self.expedited_heads += 1
            await self._run_head(job, head, self._urgent_executor)
            return
        if job not in self._jobs:  # being encoded by the worker
            # (tested before ``remove``: its ValueError formats the job's repr)
            await job.finished.wait()
            return
        self._jobs.remove(job)
        self._unhead(job)
        self.queued_chars -= job.chars
        self.queued_bytes -= job.bytes
        # on the request path's pool: the background one runs at the lowest priority, and a
        # request waiting on it would inherit that priority under CPU pressure
        await self._run_job(job, self._urgent_executor)

    def _unhead(self, job: DeferredJob) -> None:
        """``job``'s head is encoded, being encoded, or no longer wanted (it left the queue)."""
        if self._heads.get(job.fingerprint) is job:
            del self._heads[job.fingerprint]

    def _forget(self, job: DeferredJob) -> None:
        self._unhead(job)
        self.queued_chars -= job.chars
        self.queued_bytes -= job.bytes
        if self._pending.get(job.fingerprint) is job:
            del self._pending[job.fingerprint]
        job.end()

    async def _run(self) -> None:
        while True:
            if self._heads:  # heads first (module docstring)
                job = self._heads.pop(next(iter(self._heads)))
                # (the job next in line anyway is encoded whole below, in one call)
                head = None if job is self._jobs[0] else job.encoder.still_missing(job.plan).head()
                if head is not None:  # (None also when another job's encode cached it meanwhile)
                    self.heads_first += 1
                    await self._run_head(job, head, self._executor)
                del job
                continue
            if not self._jobs:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            assert not self._heads  # heads go first
            hold = self._hold(self._jobs[0])
            if hold is None:  # no lull came in time: not encoded (module docstring)
                self._forget(self._jobs.popleft())
                self.expired += 1
                continue
            if hold > 0:  # a submit (a head, or a later arrival) wakes the worker to look again
                self.lulls += 1
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), hold)
                continue
            job = self._jobs.popleft()
            self.queued_chars -= job.chars
            self.queued_bytes -= job.bytes
            if job.head_busy is not None:  # its head is being encoded for a takeover: the rest after
                await job.head_busy.wait()
            await self._run_job(job, self._executor)
            del job  # an idle worker holds no finished job

    def _hold(self, job: DeferredJob) -> float | None:
        """Seconds before the worker starts ``job``: until arrivals have paused for ``quiet_s``
        (<= 0: now); None once it has waited ``max_wait_s`` without a lull (it is not encoded)."""
        lim = self.limits
        now = asyncio.get_running_loop().time()
        lull = self._last_arrival + lim.quiet_s
        if lim.quiet_s <= 0 or lull <= now:
            return 0.0
        expires = job.queued_at + lim.max_wait_s
        return None if expires <= now else min(lull, expires) - now

    async def _run_head(
        self, job: DeferredJob, head: EncodePlan, executor: Callable[[], Executor | None]
    ) -> None:
        """Encode ``head`` (the queued job's leading segments: those a takeover shares, on the
        urgent pool, or its ``EncodePlan.head`` by the worker), cache it and record the job's
        leading keys; the job stays queued for the rest."""
        self._unhead(job)
        job.head_busy = busy = asyncio.Event()
        try:
            enc = job.encoder
            enc.remember(head, await self._encoded(job, head, executor))
            if job.on_prefix is not None:  # routed (not dropped meanwhile): its replica's entries
                leading = enc.prefix_tokens(
                    enc.still_missing(job.plan), add_special_tokens=job.add_special_tokens
                )
                job.on_prefix(job.keys_of(leading))
        except Exception:  # the job's own encode still runs (and reports) later
            log.exception("deferred head encode failed")
        finally:
            job.head_busy = None
            busy.set()

    async def _encoded(
        self,
        job: DeferredJob,
        plan: EncodePlan,
        executor: Callable[[], Executor | None],
        on_first: FirstPiece | None = None,
    ) -> list[TokenArray]:
        """``plan``'s missing segments of ``job``'s text, encoded on ``executor``'s pool (the
        background one, or the urgent one for a takeover; None: here)."""
        if plan.whole is None and not plan.missing:
            return []
        encode = functools.partial(
            job.encoder.encode_missing, plan, add_special_tokens=job.add_special_tokens, on_first=on_first
        )
        return await self._off_loop(encode, plan.missing_chars, executor)

    async def _resumed(
        self,
        job: DeferredJob,
        plan: EncodePlan,
        known: Known,
        executor: Callable[[], Executor | None],
        on_first: ResumedPiece | None,
    ) -> list[TokenArray] | None:
        """``_encoded``, its first text encoded only after ``known`` (``resume_missing``); None:
        refused (encode it whole)."""
        resumed = functools.partial(
            resume_missing, job.encoder, plan, known, job.add_special_tokens, on_first
        )
        return await self._off_loop(resumed, plan.missing_chars - known.ctx_start, executor)

    async def _off_loop(
        self, encode: Callable[[], _T], chars: int, executor: Callable[[], Executor | None]
    ) -> _T:
        """``encode()`` (of ``chars`` characters) on ``executor``'s pool (None: here), then the
        memory release (``after_encode``) on the same thread."""

        def run() -> _T:
            try:
                return encode()
            finally:
                if self._after_encode is not None:
                    self._after_encode(chars)

        pool = executor()
        return run() if pool is None else await asyncio.get_running_loop().run_in_executor(pool, run)

    async def _run_job(self, job: DeferredJob, executor: Callable[[], Executor | None]) -> None:
        try:
            enc = job.encoder
            plan = enc.still_missing(job.plan)
            found: list[tuple[list[tuple[int, Checkpoint]], TokenArray]] = []
            record: ResumedPiece | None = None
            cps = self.checkpoints
            on = cps is not None and cps.enabled and _same_first(job.plan, plan)
            if on and job.fingerprints:
                fps = job.fingerprints

                def record(
                    e: Encoding, span: tuple[int, int], shift: int, after: Known | None = None
                ) -> None:
                    found.append(checkpoints_of(e, span, shift, fps, after))  # (worker thread)

            resumed = None
            if on and job.known is not None and self._resume_next(enc.namespace):
                resumed = await self._resumed(job, plan, job.known, executor, record)
                if resumed is not None:
                    self.resumed += 1
            done = resumed if resumed is not None else await self._encoded(job, plan, executor, record)
            if found and cps is not None:
                checkpoints, own = found[0]
                # a head composed from checkpoints is checked against a whole encode before more
                # are learned from it (a resumed encode's own check is its context word's)
                if resumed is not None or job.head_check is None or cps.check(job.head_check, own):
                    cps.learn(checkpoints)
            if job.on_keys is None:  # not routed (explain, or no replica): only cache the segments
                enc.remember(plan, done)
            else:
                job.on_keys(job.keys_of(enc.finish(plan, done, add_special_tokens=job.add_special_tokens)))
            self.encoded += 1
        except Exception:  # one bad job must not stop the worker
            self.failed += 1
            log.exception("deferred encode failed")
        finally:
            if self._pending.get(job.fingerprint) is job:
                del self._pending[job.fingerprint]
            job.end()

    def _resume_next(self, namespace: str) -> bool:
        """Whether the next job of tokenizer ``namespace`` whose head came from checkpoints resumes
        after them: every one but its first and each ``CHECK_EVERY``-th after it, which encode
        whole to check the head (per tokenizer: the premise checked is the tokenizer's)."""
        n = self._from_checkpoints.get(namespace, 0)
        self._from_checkpoints[namespace] = n + 1
        return n % CHECK_EVERY != 0

    async def drain(self) -> None:
        """Until every queued job is done."""
        await self._idle.wait()

    async def close(self) -> None:
        """Cancel the worker; queued jobs are discarded."""
        while self._jobs:
            self._forget(self._jobs.popleft())
        self._idle.set()
        if self._worker is not None:
            worker, self._worker = self._worker, None
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
