"""Taking a waiting deferred encode over: a request bringing the same new text as a job still
queued encodes it at once (on the urgent pool) and is matched exactly on the first request's
replica; one sharing only the job's leading segments (a new system prompt) encodes only those,
and the job keeps the rest."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gateway.features.budgets import DeferredLimits
from gateway.features.deferred import DeferredEncodes
from gateway.features.deferred_job import DeferredJob
from gateway.features.segment_encoder import BoundedLRU, EncodePlan, SegmentEncoder
from gateway.features.tokenizer_files import load_tokenizer_files
from tests.unit.test_features_deferred import SYSTEM, TINY, chat, closing, make, text
from tests.unit.test_features_heads_first import spied_encoder


async def test_a_burst_on_new_text_finds_the_first_requests_entries() -> None:
    """The second request of a burst takes the first one's waiting encode over: the first
    request's replica gets the whole prompt's keys before the second is matched."""
    async with closing(make(threads=1), make(defer_chars=0)) as (fz, exact):
        doc = text(40, 800)
        first_body = chat(SYSTEM, doc)
        _, first = await fz.features("chat", first_body)
        assert first.deferred is not None
        recorded: list[list[int]] = []
        first.deferred.on_keys = recorded.append  # what the proxy does once it has routed
        second, second_info = await fz.features("chat", first_body)  # no await in between
        assert second_info.exact and fz.cache_stats()["deferred_expedited"] == 1
        want, _ = await exact.features("chat", first_body)
        assert recorded == [list(want.block_keys)] == [list(second.block_keys)]
        # a job finished normally also hands over its keys, once
        _, third = await fz.features("chat", chat(SYSTEM, text(41, 800)))
        assert third.deferred is not None
        later: list[list[int]] = []
        third.deferred.on_keys = later.append
        await fz.deferred.drain()
        assert len(later) == 1 and len(later[0]) > 20


async def test_an_expedited_encode_runs_on_the_urgent_pool_not_the_background_one() -> None:
    """A request taking a waiting job over must not wait behind the background thread: with that
    thread busy (here: blocked), the expedited encode still finishes, on the urgent pool."""
    tok = load_tokenizer_files(Path(TINY), where="t").tokenizer
    enc = SegmentEncoder(tok, BoundedLRU(100), "t")
    background = ThreadPoolExecutor(1, thread_name_prefix="bg")
    urgent = ThreadPoolExecutor(1, thread_name_prefix="urgent")
    release = threading.Event()
    background.submit(release.wait, 30)  # the background thread is busy with older work
    deferred = DeferredEncodes(DeferredLimits(100_000), lambda: background, lambda: urgent)
    keys: list[list[int]] = []
    job = DeferredJob(enc, enc.plan(text(50, 300), add_special_tokens=False), False, 7, lambda t: [len(t)])
    job.on_keys = keys.append
    try:
        deferred.submit(job)  # no await since: still queued, so expedite encodes it itself
        async with asyncio.timeout(10):  # (not wait_for: a new task would let the worker run)
            await deferred.expedite(7)
        assert deferred.expedited == 1 and deferred.encoded == 1 and len(keys) == 1
    finally:
        release.set()
        await deferred.close()
        background.shutdown()
        urgent.shutdown()


async def test_a_shared_head_is_taken_over_and_the_new_tail_still_deferred() -> None:
    """Two requests with one long new head (a system prompt) and different new tails, the second
    while the first's encode waits: the second takes over only the head's encode (the head is then
    cached and keyed exactly, on the first request's replica through ``on_prefix``); the first
    request's own tail stays queued (the second does not wait for it) and its whole keys come
    later through ``on_keys``; the second's new tail is routed on an estimate and encoded after
    routing, not on the request path."""
    async with closing(make(threads=1), make(defer_chars=0)) as (fz, exact):
        head = text(50, 600)  # ~4,000 characters: many blocks of new text shared
        first_body = chat(head, text(51, 400))
        _, first = await fz.features("chat", first_body)
        assert first.deferred is not None
        recorded: list[list[int]] = []
        prefix: list[list[int]] = []
        first.deferred.on_keys, first.deferred.on_prefix = recorded.append, prefix.append  # as the proxy
        second_body = chat(head, text(52, 400))
        second, info = await fz.features("chat", second_body)  # no await in between
        stats = fz.cache_stats()
        assert stats["deferred_expedited"] == 1 and stats["deferred_expedited_heads"] == 1
        assert len(prefix) == 1 and recorded == [] and fz.deferred.pending(first.deferred.fingerprint)
        assert info.deferred is not None and info.deferred_chars > 1500 and info.encoded_chars < 600
        want, _ = await exact.features("chat", second_body)
        first_want, _ = await exact.features("chat", first_body)
        # the first request's leading keys, exact, through the whole head and not its own tail
        assert prefix[0] == list(first_want.block_keys)[: len(prefix[0])]
        assert len(head) // 8 // 16 <= len(prefix[0]) < len(first_want.block_keys) - 10
        # they are the second's leading keys too, and it is keyed exactly through them at least
        assert prefix[0] == list(want.block_keys)[: len(prefix[0])]
        assert len(prefix[0]) <= len(second.block_keys)
        assert list(second.block_keys) == list(want.block_keys)[: len(second.block_keys)]
        later: list[list[int]] = []
        info.deferred.on_keys = later.append
        await fz.deferred.drain()
        assert later == [list(want.block_keys)] and recorded == [list(first_want.block_keys)]


async def test_takeovers_of_one_head_at_once_encode_it_once_and_the_worker_waits_for_it() -> None:
    """Two requests sharing a queued job's head take it over together: one encodes the head (on
    the urgent pool), the other waits for it, and so does the background worker when it reaches
    the job meanwhile; the head is encoded once, the job's own tail after it, by the worker."""
    tok = load_tokenizer_files(Path(TINY), where="t").tokenizer
    enc, encoded = spied_encoder(100)  # encoded: every text given to the tokenizer
    background = ThreadPoolExecutor(1, thread_name_prefix="bg")
    urgent = ThreadPoolExecutor(1, thread_name_prefix="urgent")
    bg_free, urgent_free = threading.Event(), threading.Event()
    background.submit(bg_free.wait, 30)  # both pools busy with older work at first
    urgent.submit(urgent_free.wait, 30)
    deferred = DeferredEncodes(DeferredLimits(100_000), lambda: background, lambda: urgent)
    head, tail = text(70, 300), text(71, 200)
    prefix: list[list[int]] = []
    whole: list[list[int]] = []
    earlier = DeferredJob(enc, enc.plan(text(69, 50), add_special_tokens=False), False, 1, lambda t: [len(t)])
    job = DeferredJob(
        enc, enc.plan(head + "<|im_end|>" + tail, add_special_tokens=False), False, 2, lambda t: [len(t)]
    )
    job.on_prefix, job.on_keys = prefix.append, whole.append
    try:
        deferred.submit(earlier)
        await asyncio.sleep(0.05)  # the worker took it and waits for the background pool
        deferred.submit(job)  # (queued with earlier, its head would go first: test_features_heads_first.py)
        assert len(deferred) == 1  # the job is queued behind
        takeovers = [asyncio.ensure_future(deferred.expedite(2, len(head) + 10)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert deferred.expedited == 2 and deferred.expedited_heads == 1 and job.head_busy is not None
        bg_free.set()  # the worker finishes the earlier job and reaches this one: it waits
        async with asyncio.timeout(10):
            while len(deferred):  # noqa: ASYNC110 (the worker taking a job sets no event)
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # (time for a worker that did not wait to encode it all)
        assert not any(t.done() for t in takeovers) and whole == []
        urgent_free.set()
        async with asyncio.timeout(10):
            await asyncio.gather(*takeovers)
            await deferred.drain()
        want = len(
            enc.finish(
                enc.plan(head + "<|im_end|>" + tail, add_special_tokens=False), [], add_special_tokens=False
            )
        )
        head_tokens = len(tok.encode(head, add_special_tokens=False).ids) + 1  # and <|im_end|>
        assert prefix == [[head_tokens]] and whole == [[want]]
        assert deferred.encoded == 2 and deferred.failed == 0
        assert sum(head in t for t in encoded) == 1 and sum(tail in t for t in encoded) == 1
    finally:
        bg_free.set()
        urgent_free.set()
        await deferred.close()
        background.shutdown()
        urgent.shutdown()


async def test_a_takeover_of_the_same_text_encodes_the_whole_job() -> None:
    """A request sharing all of a waiting job's new text (a burst on one document) takes the whole
    encode over, as before the head-only takeover: matched exactly, the job done."""
    async with closing(make(threads=1)) as (fz,):
        body = chat(text(60, 600), text(61, 400))
        _, first = await fz.features("chat", body)
        assert first.deferred is not None
        recorded: list[list[int]] = []
        first.deferred.on_keys = first.deferred.on_prefix = recorded.append
        second, info = await fz.features("chat", body)
        stats = fz.cache_stats()
        assert stats["deferred_expedited"] == 1 and stats["deferred_expedited_heads"] == 0
        assert info.exact and recorded == [list(second.block_keys)]


def test_a_plans_leading_part_is_its_missing_segments_within_the_shared_characters() -> None:
    """``EncodePlan.leading``: the missing segments with at least ``overlap`` characters (or all
    of theirs) in the first ``end``; None when that is none or all of them, or for one piece."""
    tok = load_tokenizer_files(Path(TINY), where="t").tokenizer
    enc = SegmentEncoder(tok, BoundedLRU(100), "t")
    a, b, c = text(80, 100), text(81, 10), text(82, 100)
    plan = enc.plan(f"{a}<|im_end|>{b}<|im_end|>{c}", add_special_tokens=False)
    assert plan.missing == [0, 1, 2]
    b_start = len(a) + len("<|im_end|>")
    head = plan.leading(b_start + 5, 256)
    assert head is not None and head.missing == [0] and plan.missing == [0, 1, 2]
    # b (shorter than the overlap) counts once it lies whole in the shared characters
    head = plan.leading(b_start + len(b), 256)
    assert head is not None and head.missing == [0, 1]
    head = plan.leading(b_start + len(b) - 1, 256)
    assert head is not None and head.missing == [0]
    assert plan.leading(100, 256) is None  # not even a's first 256 characters
    assert plan.leading(len(a) * 10, 256) is None  # all of them: the whole job
    one_piece = EncodePlan(keys=[], found=[], separators=[], whole=a)
    assert one_piece.leading(len(a), 1) is None


async def test_a_burst_on_a_document_with_another_question_defers_the_new_question() -> None:
    """Two completions on one new document with different questions, the second while the
    first's encode waits: the second takes the first's encode over (the document is then cached
    in checkpoints and keyed on the first request's replica), and its own question is new text
    like any other, routed on the document's exact tokens and encoded after routing. Its first
    planning pass must not count its own text as seen before: that made it encode the whole
    prompt again on the request path (measured on the held-out RAG trace: 2,243-8,705 characters
    on the event loop, 6-28 ms of dispatch; docs/performance.md)."""
    async with closing(make(threads=1), make(defer_chars=0)) as (fz, exact):
        doc = text(70, 700)
        first_body = {"model": "tiny", "prompt": doc + " " + text(71, 30)}
        _, first = await fz.features("completions", first_body)
        assert first.deferred is not None
        recorded: list[list[int]] = []
        first.deferred.on_keys = recorded.append  # as the proxy
        second_body = {"model": "tiny", "prompt": doc + " " + text(72, 30)}
        second, info = await fz.features("completions", second_body)  # no await in between
        assert fz.cache_stats()["deferred_expedited"] == 1
        first_want, _ = await exact.features("completions", first_body)
        assert recorded == [list(first_want.block_keys)]  # the first's entries before the second's match
        # the second: routed on the document's exact head, its question encoded after routing
        assert info.deferred is not None and info.deferred_chars > 0
        assert info.encoded_chars < len(doc) // 2 and fz.checkpoints.composed == 1
        want, _ = await exact.features("completions", second_body)
        assert len(second.block_keys) > len(doc) // 8 // 16
        assert list(second.block_keys) == list(want.block_keys)[: len(second.block_keys)]
        later: list[list[int]] = []
        info.deferred.on_keys = later.append
        await fz.deferred.drain()
        assert later == [list(want.block_keys)]
