"""Heads first (gateway/features/deferred.py): with encodes queued, the worker encodes every queued
job's leading new segments (``EncodePlan.head``) before any job's remaining text, records them on
the job's replica (``on_prefix``), and the queue of heads only ever holds queued jobs."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gateway.features.budgets import DeferredLimits
from gateway.features.deferred import DeferredEncodes
from gateway.features.deferred_job import DeferredJob
from gateway.features.segment_encoder import BoundedLRU, SegmentEncoder
from gateway.features.tokenizer_files import load_tokenizer_files
from tests.unit.test_features_deferred import TINY, text

SEP = "<|im_end|>"  # an added token of the tiny tokenizer: a segment boundary


def spied_encoder(entries: int = 1000) -> tuple[SegmentEncoder, list[str]]:
    """An encoder over the tiny tokenizer, and the list of every text it is given, in order."""
    tok = load_tokenizer_files(Path(TINY), where="t").tokenizer
    enc = SegmentEncoder(tok, BoundedLRU(entries), "t")
    seen: list[str] = []

    def encode_batch(texts: list[str], **kw: Any) -> Any:
        seen.extend(texts)
        return tok.encode_batch(texts, **kw)

    def encode(text: str, **kw: Any) -> Any:
        seen.append(text)
        return tok.encode(text, **kw)

    enc.tokenizer = SimpleNamespace(encode_batch=encode_batch, encode=encode)  # type: ignore[assignment]
    return enc, seen


def _job(enc: SegmentEncoder, body: str, fingerprint: int) -> DeferredJob:
    return DeferredJob(enc, enc.plan(body, add_special_tokens=False), False, fingerprint, lambda t: [len(t)])


def _heads_are_queued(d: DeferredEncodes) -> bool:
    queued = {id(j) for j in d._jobs}
    return all(id(j) in queued for j in d._heads.values())


async def test_queued_heads_are_encoded_before_any_queued_tail() -> None:
    """Three jobs wait behind a busy worker: one new message (a), a new system prompt and its
    message (b), another new message (c). The worker encodes b's system prompt first, records its
    leading keys on b's replica, then a, b's message and c in arrival order."""
    enc, seen = spied_encoder()
    background = ThreadPoolExecutor(1, thread_name_prefix="bg")
    free = threading.Event()
    background.submit(free.wait, 30)  # the worker's first job waits behind older work
    d = DeferredEncodes(DeferredLimits(1_000_000), lambda: background)
    first, a, system, b_msg, c = (text(i, 120) for i in range(90, 95))
    jobs = [_job(enc, first, 1), _job(enc, a, 2), _job(enc, system + SEP + b_msg, 3), _job(enc, c, 4)]
    prefix: list[list[int]] = []
    whole: list[list[int]] = []
    jobs[2].on_prefix, jobs[2].on_keys = prefix.append, whole.append  # as the proxy, once routed
    try:
        d.submit(jobs[0])
        await asyncio.sleep(0.05)  # the worker took it and waits for the pool
        for j in jobs[1:]:
            d.submit(j)
        assert list(d._heads.values()) == [jobs[2]] and _heads_are_queued(d)
        free.set()
        async with asyncio.timeout(10):
            await d.drain()
        order = [next(i for i, t in enumerate(seen) if part in t) for part in (first, system, a, b_msg, c)]
        assert order == sorted(order), seen
        assert d.heads_first == 1 and d.encoded == 4 and d.failed == 0 and not d._heads
        head_tokens = len(enc.tokenizer.encode_batch([system], add_special_tokens=False)[0].ids) + 1
        assert prefix == [[head_tokens]]  # the system prompt and its <|im_end|>, nothing of b_msg
        assert len(whole) == 1 and whole[0][0] > head_tokens
    finally:
        free.set()
        await d.close()
        background.shutdown()


async def test_a_head_another_job_cached_meanwhile_is_not_encoded_again() -> None:
    """Two queued jobs with the same new system prompt: the worker encodes it once (for the older
    job); the younger's head is then cached, so it is skipped, not encoded twice."""
    enc, seen = spied_encoder()
    background = ThreadPoolExecutor(1, thread_name_prefix="bg")
    free = threading.Event()
    background.submit(free.wait, 30)
    d = DeferredEncodes(DeferredLimits(1_000_000), lambda: background)
    system = text(100, 150)
    try:
        d.submit(_job(enc, text(101, 50), 1))
        await asyncio.sleep(0.05)
        d.submit(_job(enc, system + SEP + text(102, 80), 2))
        d.submit(_job(enc, system + SEP + text(103, 80), 3))
        assert len(d._heads) == 2
        free.set()
        async with asyncio.timeout(10):
            await d.drain()
        assert sum(system in t for t in seen) == 1 and d.heads_first == 1 and d.encoded == 3
    finally:
        free.set()
        await d.close()
        background.shutdown()


async def test_the_heads_queue_only_holds_queued_jobs() -> None:
    """A job dropped from a full backlog, or taken over whole, leaves the heads queue with it
    (its text is not held beyond the backlog's bounds, and its head is not encoded twice); the
    job next in line is encoded whole, its head not apart."""
    enc, _ = spied_encoder()
    background = ThreadPoolExecutor(1, thread_name_prefix="bg")
    urgent = ThreadPoolExecutor(1, thread_name_prefix="urgent")
    free = threading.Event()
    background.submit(free.wait, 30)
    bodies = [text(110 + i, 60) + SEP + text(120 + i, 60) for i in range(3)]
    jobs = [_job(enc, b, 10 + i) for i, b in enumerate(bodies)]
    d = DeferredEncodes(
        DeferredLimits(jobs[1].chars + jobs[2].chars + 10), lambda: background, lambda: urgent
    )
    try:
        d.submit(_job(enc, text(130, 10), 1))
        await asyncio.sleep(0.05)  # the worker holds this one
        d.submit(jobs[0])
        d.submit(jobs[1])
        assert list(d._heads) == [10, 11]
        d.submit(jobs[2])  # the backlog is full: the oldest (jobs[0]) is dropped
        assert d.dropped == 1 and list(d._heads) == [11, 12] and _heads_are_queued(d)
        async with asyncio.timeout(10):
            await d.expedite(11)  # taken over whole (all its text shared)
        assert list(d._heads) == [12] and _heads_are_queued(d)
        free.set()
        async with asyncio.timeout(10):
            await d.drain()
        assert not d._heads and d.heads_first == 0 and d.encoded == 3 and d.failed == 0
    finally:
        free.set()
        await d.close()
        background.shutdown()
        urgent.shutdown()
