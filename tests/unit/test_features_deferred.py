"""Routing before encoding new text: the keys are always a prefix of the exact keys, the new text
is encoded after routing into the segment cache and its keys handed to the proxy, and the record
of seen texts and the backlog of deferred encodes are bounded (a request taking a waiting encode
over: test_features_takeover.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import tracemalloc
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from gateway.config import ModelConfig
from gateway.features import EncodeSettings, Featurizer
from gateway.features.budgets import SEEN_ENTRY_BYTES, DeferredLimits
from gateway.features.deferred import DeferredEncodes
from gateway.features.deferred_job import DeferredJob
from gateway.features.novelty import SeenTexts
from gateway.features.segment_encoder import BoundedLRU, SegmentEncoder
from gateway.features.tokenizer_files import load_tokenizer_files

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "assets/tokenizers/kvgate-tiny")
WORDS = (ROOT / "assets/corpus/stdlib_docstrings.txt").read_text(encoding="utf-8").split()[:5000]
SYSTEM = "You are a careful assistant. " * 20


def _metaspace() -> Tokenizer:
    """A SentencePiece-style BPE (Metaspace pre-tokenizer, NFC), with the test's added token."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<unk>", "<|im_start|>"], show_progress=False
    )
    tok.train_from_iterator([" ".join(WORDS)], trainer)
    return tok


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make(defer_chars: int = 1000, **kw: Any) -> Featurizer:
    settings = EncodeSettings(cache_entries=kw.pop("cache_entries", 1000), defer_chars=defer_chars, **kw)
    return Featurizer([ModelConfig(name="tiny", tokenizer=TINY, block_size=16)], settings)


@contextlib.asynccontextmanager
async def closing(*fzs: Featurizer) -> AsyncIterator[tuple[Featurizer, ...]]:
    """The featurizers, closed (threads and backlog) when the block ends."""
    try:
        yield fzs
    finally:
        for fz in fzs:
            await fz.close()


def chat(*contents: str) -> dict[str, Any]:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return {
        "model": "tiny",
        "messages": [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)],
    }


async def test_new_text_routes_on_the_exact_cached_prefix_and_is_encoded_after() -> None:
    async with closing(make(), make(defer_chars=0)) as (fz, exact):
        await fz.features("chat", chat(SYSTEM, "hi"))  # caches the system prompt's segment
        await fz.deferred.drain()
        body = chat(SYSTEM, text(1, 600))
        want, want_info = await exact.features("chat", body)
        got, info = await fz.features("chat", body)
        assert info.deferred_chars > 1000 and not info.exact and info.token_ids is None
        assert want_info.exact and want_info.deferred_chars == 0
        keys = list(got.block_keys)
        assert 0 < len(keys) < len(want.block_keys)
        assert keys == list(want.block_keys)[: len(keys)]  # never a wrong key, only fewer
        # the estimate comes from this tokenizer's characters per token so far
        assert 0.6 * want.prompt_tokens < got.prompt_tokens < 1.4 * want.prompt_tokens
        assert fz.cache_stats()["deferred"] == 1
        await fz.deferred.drain()
        assert fz.cache_stats()["deferred_encoded"] == 1
        # the next turn repeats the message: now encoded exactly, from the cache
        again, again_info = await fz.features("chat", body)
        assert again_info.exact and again_info.cache_hit and again_info.encoded_chars == 0
        assert list(again.block_keys) == list(want.block_keys)
        assert again.prompt_tokens == want.prompt_tokens


async def test_text_seen_before_is_encoded_before_routing() -> None:
    async with closing(make(threads=1), make(defer_chars=0)) as (fz, exact):
        body = {"model": "tiny", "prompt": text(2, 700)}
        _, first = await fz.features("completions", body)
        # the same text again, before or after the deferred encode: exact either way
        _, second = await fz.features("completions", body)
        assert first.deferred_chars > 0 and first.encoded_chars == 0 and second.exact
        # a new text sharing its first 1,000 characters: every block it can share is keyed (it
        # may be cached somewhere), the rest is routed on an estimate
        shared = {"model": "tiny", "prompt": body["prompt"][:1000] + text(3, 500)}
        got, third = await fz.features("completions", shared)
        want, _ = await exact.features("completions", shared)
        before, _ = await exact.features("completions", body)
        common = 0
        while list(want.block_keys)[common] == list(before.block_keys)[common]:
            common += 1
        # (encoded: only what follows the first text's checkpoints, once its deferred encode ran;
        # otherwise its first 1,000 characters and a block more: test_prefix_checkpoints.py)
        assert 0 < third.encoded_chars < 1400 and third.deferred_chars > 2000
        assert common <= len(got.block_keys) < common + 8
        assert list(got.block_keys) == list(want.block_keys)[: len(got.block_keys)]


async def test_short_truncated_or_disabled_never_defer() -> None:
    async with closing(make(defer_chars=5000), make(defer_chars=0)) as (fz, off):
        _, short = await fz.features("completions", {"model": "tiny", "prompt": text(4, 300)})
        assert short.exact
        long = {"model": "tiny", "prompt": text(5, 2000)}
        _, trunc = await fz.features("completions", {**long, "truncate_prompt_tokens": 100})
        assert trunc.exact and trunc.prompt_tokens == 100
        _, disabled = await off.features("completions", long)
        assert disabled.exact
        _, sync = fz.features_sync("completions", {"model": "tiny", "prompt": text(6, 2000)})
        assert sync.exact


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    turns=st.lists(st.integers(min_value=0, max_value=500), min_size=1, max_size=5),
    cached=st.integers(min_value=0, max_value=5),
    shared=st.integers(min_value=0, max_value=4000),
    seed=st.integers(min_value=0, max_value=10**6),
)
def test_deferred_keys_are_a_prefix_of_the_exact_keys(
    turns: list[int], cached: int, shared: int, seed: int
) -> None:
    async def run() -> None:
        async with closing(make(defer_chars=1), make(defer_chars=0)) as (fz, exact):
            contents = [text(seed + i, n) for i, n in enumerate(turns)]
            # some leading messages were seen (and encoded) in an earlier turn
            if cached:
                await fz.features("chat", chat(SYSTEM, *contents[:cached]))
                await fz.deferred.drain()
            # and an earlier request shared the start of the last message (not encoded)
            if shared:
                await fz.features("chat", chat(SYSTEM, *contents[:-1], contents[-1][:shared] + "!"))
            body = chat(SYSTEM, *contents)
            got, _ = await fz.features("chat", body)
            want, _ = await exact.features("chat", body)
            assert list(got.block_keys) == list(want.block_keys)[: len(got.block_keys)]

    asyncio.run(run())


def _no_pretokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|im_start|>"], show_progress=False
    )
    tok.train_from_iterator([" ".join(WORDS[:2000])], trainer)
    return tok


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=10**6),
    cut=st.integers(min_value=0, max_value=3000),
    which=st.sampled_from(["tiny", "metaspace"]),
)
def test_head_tokens_are_the_exact_leading_tokens(seed: int, cut: int, which: str) -> None:
    """Encoding a cut segment keeps only tokens the whole segment has in the same places, for
    byte-level and SentencePiece-style pre-tokenizers, with odd whitespace and punctuation."""
    tok = load_tokenizer_files(Path(TINY), where="t").tokenizer if which == "tiny" else _metaspace()
    enc = SegmentEncoder(tok, BoundedLRU(10), "t")
    rng = random.Random(seed)
    pieces = [
        rng.choice(WORDS) + rng.choice(["", " ", "  ", "\n", ", ", "...", "\t", "  \n\n"]) for _ in range(500)
    ]
    body = "<|im_start|>" + "".join(pieces)
    plan = enc.plan(body, add_special_tokens=False)
    assert len(plan.missing) == 1
    full = enc.encode(body, add_special_tokens=False)[1:]  # drop <|im_start|>
    head, covered = enc.head_tokens(plan, cut)
    assert list(head) == list(full[: len(head)])
    assert covered <= cut
    if cut > 100:
        assert len(head) > 0


def test_head_tokens_keep_nothing_without_a_pre_tokenizer() -> None:
    enc = SegmentEncoder(_no_pretokenizer(), BoundedLRU(10), "t")
    plan = enc.plan("<|im_start|>" + text(9, 300), add_special_tokens=False)
    head, covered = enc.head_tokens(plan, 1000)
    assert len(head) == 0 and covered == 0


def test_seen_texts_are_bounded_and_refreshed() -> None:
    seen = SeenTexts(3)

    def run_then_record(fps: list[int]) -> int:
        run = seen.seen_run(fps)
        seen.record(fps)
        return run

    assert seen.seen_run([1, 2]) == 0 and len(seen) == 0  # reading records nothing
    assert run_then_record([1, 2]) == 0
    assert run_then_record([1, 2, 3]) == 2  # leading run; 3 recorded too
    assert run_then_record([1]) == 1  # refreshed: 2 is now the oldest
    assert run_then_record([4]) == 0
    assert len(seen) == 3
    assert seen.seen_run([2]) == 0  # forgotten
    assert seen.seen_run([5, 1]) == 0  # a run must start at the first block
    never = SeenTexts(0)
    never.record([7])
    assert never.seen_run([7]) == 0 and len(never) == 0
    with pytest.raises(ValueError):
        SeenTexts(-1)
    a = SeenTexts.fingerprints(1, "abc" + "x" * 300, 3)
    b = SeenTexts.fingerprints(1, "abc" + "x" * 256 + "y" * 44, 3)
    assert len(a) == len(b) == 2 and a[0] == b[0] and a[1] != b[1]  # chained per PROBE_CHARS
    assert a[0] != SeenTexts.fingerprints(2, "abc" + "x" * 300, 3)[0]  # seeded per tokenizer
    assert a[0] != SeenTexts.fingerprints(1, "abd" + "x" * 300, 3)[0]  # and by the text before


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 9), st.lists(st.lists(st.integers(0, 30), max_size=12), max_size=40))
def test_seen_texts_remember_the_most_recent_within_their_bound(
    capacity: int, batches: list[list[int]]
) -> None:
    """novelty.py's invariants against a reference order of last records: at most ``capacity``
    entries; the last ``ceil(capacity / 2)`` distinct fingerprints remembered; what is remembered
    is a most recent run of that order (only the least recently seen is ever forgotten)."""
    seen = SeenTexts(capacity)
    order: list[int] = []  # distinct fingerprints, the most recently recorded last
    for fps in batches:
        seen.record(fps)
        for fp in fps:
            if fp in order:
                order.remove(fp)
            order.append(fp)
        assert len(seen) <= capacity
        kept = [fp for fp in order if seen.seen_run([fp]) == 1]
        assert len(kept) >= min(len(order), (capacity + 1) // 2)
        assert kept == order[len(order) - len(kept) :]


def test_seen_texts_hold_at_most_their_budget_in_bytes() -> None:
    """``SEEN_ENTRY_BYTES`` a fingerprint of capacity bounds the record's memory at its peak (a
    generation dropped, a table resized), over many generations of new fingerprints."""
    capacity, rng = 20_000, random.Random(3)
    batches = [[rng.getrandbits(64) for _ in range(32)] for _ in range(4 * capacity // 32)]
    tracemalloc.start()
    try:
        seen = SeenTexts(capacity)
        for fps in batches:
            seen.record(fps)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(seen) >= capacity // 2
    assert peak <= capacity * SEEN_ENTRY_BYTES, peak / capacity


async def test_backlog_is_bounded_in_characters_and_drops_the_oldest() -> None:
    tok = load_tokenizer_files(Path(TINY), where="t").tokenizer
    cache = BoundedLRU(100)
    enc = SegmentEncoder(tok, cache, "t")
    deferred = DeferredEncodes(DeferredLimits(2500), lambda: None)

    def job(plan_text: str, fingerprint: int) -> DeferredJob:
        plan = enc.plan(plan_text, add_special_tokens=False)
        return DeferredJob(enc, plan, False, fingerprint, lambda tokens: [len(tokens)])

    try:
        jobs = [job(text(10 + i, 150) + "<|im_end|>", i) for i in range(4)]
        assert all(700 < j.chars < 1250 for j in jobs)
        for j in jobs:  # no await in between: the worker has not run yet
            deferred.submit(j)
        assert deferred.queued_chars <= 2500 and deferred.dropped == 2
        assert [deferred.pending(i) for i in range(4)] == [False, False, True, True]
        deferred.submit(job(text(20, 2000), 9))  # larger than the whole backlog
        assert deferred.dropped == 3 and not deferred.pending(9)
        await deferred.drain()
        assert deferred.encoded == 2 and deferred.queued_chars == 0 and not deferred.pending(3)
        assert [cache.peek(j.plan.keys[0]) is not None for j in jobs] == [False, False, True, True]
    finally:
        await deferred.close()


def test_a_jobs_repr_names_it_without_its_text() -> None:
    """A job's repr is short whatever its text: the generated one printed the whole text and its
    arrays, and ``deque.remove`` of a job no longer queued formats it into its ValueError (on
    the request path: a takeover of a job the worker was encoding)."""
    tok = load_tokenizer_files(Path(TINY), where="t").tokenizer
    enc = SegmentEncoder(tok, BoundedLRU(100), "t")
    job = DeferredJob(enc, enc.plan(text(3, 5000), add_special_tokens=False), False, 0xAB, lambda t: [len(t)])
    assert job.chars > 20_000
    assert repr(job) == f"DeferredJob(fingerprint=0xab, chars={job.chars})"


async def test_close_cancels_the_worker_and_discards_the_backlog() -> None:
    fz = make(defer_chars=1)
    await fz.features("chat", chat(SYSTEM, text(30, 400)))
    assert fz.deferred._worker is not None
    await fz.close()
    assert fz.deferred._worker is None and fz.deferred.queued_chars == 0
    assert fz.executor._executor is None


async def test_an_ended_job_lets_its_callbacks_go_so_refcounting_frees_it() -> None:
    """DeferredJob's invariant: callbacks that close over their job (as the operator view's and
    the audit's do) form no cycle once the job ends, encoded or dropped: with the cycle collector
    off, dropping the last reference frees the job."""
    tok = load_tokenizer_files(Path(TINY), where="t").tokenizer
    enc = SegmentEncoder(tok, BoundedLRU(100), "t")
    deferred = DeferredEncodes(DeferredLimits(2500), lambda: None)
    got: list[list[int]] = []

    def job(seed: int, words: int) -> weakref.ref[DeferredJob]:
        j = DeferredJob(
            enc, enc.plan(text(seed, words), add_special_tokens=False), False, seed, lambda t: [len(t)]
        )

        def on_keys(keys: list[int]) -> None:  # closes over j: a cycle while j holds it
            got.append(keys) if j.on_keys is not None else None

        j.on_keys = j.on_prefix = on_keys
        deferred.submit(j)
        return weakref.ref(j)

    gc.collect()
    gc.disable()
    try:
        encoded, dropped = job(1, 100), job(2, 2000)  # the second is larger than the backlog
        await deferred.drain()
        assert len(got) == 1 and deferred.dropped == 1
        assert encoded() is None and dropped() is None  # freed without the cycle collector
    finally:
        gc.enable()
        await deferred.close()
