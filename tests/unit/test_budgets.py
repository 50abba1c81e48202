"""Byte budgets of what clients fill (gateway/features/budgets.py): the segment cache, the deferred
backlog and encodes in flight are bounded in bytes, a prompt above the cap is refused before it
is encoded, and the bytes held are reported (issue 13, finding 1)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np
import pytest

from gateway.config import ModelConfig, parse_config
from gateway.features import EncodeSettings, Featurizer
from gateway.features.budgets import (
    SEGMENT_ENTRY_OVERHEAD,
    Budgets,
    ByteBudget,
    DeferredLimits,
    MemoryReleaser,
    non_negative,
    text_bytes,
)
from gateway.features.deferred import DeferredEncodes
from gateway.features.deferred_job import DeferredJob
from gateway.features.segment_encoder import BoundedLRU, SegmentEncoder
from gateway.features.tokenizer_files import load_tokenizer_files
from gateway.openai_errors import RequestError
from gateway.request import request_of

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "assets/tokenizers/kvgate-tiny")


def _text(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "kv", "cache", "the"]
    out = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(chars // 6))
    return out[:chars]


def test_segment_cache_is_bounded_in_bytes_and_evicts_least_recent() -> None:
    ids = np.zeros(1000, dtype=np.uint32)
    one = text_bytes("a" * 10_000) + ids.nbytes + SEGMENT_ENTRY_OVERHEAD
    lru = BoundedLRU(capacity=1000, max_bytes=3 * one)
    keys = [("t", "", chr(ord("a") + i) * 10_000, "") for i in range(5)]
    for k in keys[:3]:
        lru.put(k, ids)
    assert lru.bytes == 3 * one and len(lru) == 3
    assert lru.get(keys[0]) is not None  # refreshed: keys[1] is now the oldest
    lru.put(keys[3], ids)
    assert lru.bytes <= 3 * one and lru.evictions == 1
    assert lru.peek(keys[1]) is None and lru.peek(keys[0]) is not None
    lru.put(keys[3], ids)  # replacing an entry does not count it twice
    assert lru.bytes == 3 * one
    lru.put(("t", "", "z" * 1_000_000, ""), ids)  # larger than the whole bound: not cached
    assert lru.bytes == 3 * one and len(lru) == 3
    with pytest.raises(ValueError):
        BoundedLRU(1, max_bytes=-1)


def test_text_bytes_counts_wide_characters() -> None:
    assert text_bytes("é" * 1000) < text_bytes("€" * 1000) < text_bytes("😀" * 1000)
    assert text_bytes("😀" * 1000) >= 4000


async def test_deferred_backlog_is_bounded_in_bytes() -> None:
    tok = load_tokenizer_files(Path(TINY), where="t").tokenizer
    enc = SegmentEncoder(tok, BoundedLRU(100), "t")
    # wide characters: the same number of characters holds 4 times the bytes
    texts = [_text(i, 1000).replace("a", "😀") for i in range(4)]
    jobs = []
    for i, t in enumerate(texts):
        plan = enc.plan(t, add_special_tokens=False)
        jobs.append(DeferredJob(enc, plan, False, i, lambda tokens: [len(tokens)]))
    per_job = jobs[0].bytes
    assert per_job > 2 * jobs[0].chars
    deferred = DeferredEncodes(DeferredLimits(10**9, int(2.5 * per_job)), lambda: None)
    try:
        for j in jobs:
            deferred.submit(j)
        assert deferred.queued_bytes <= 2.5 * per_job and deferred.dropped == 2
        assert [deferred.pending(i) for i in range(4)] == [False, False, True, True]
        await deferred.drain()
        assert deferred.queued_bytes == 0 and deferred.encoded == 2
    finally:
        await deferred.close()


async def test_byte_budget_makes_holders_wait_and_lets_a_large_one_run_alone() -> None:
    budget = ByteBudget(100)
    order: list[str] = []
    release = asyncio.Event()

    async def holder(name: str, n: int) -> None:
        async with budget.hold(n):
            order.append(name)
            assert budget.held <= budget.limit or budget.held == n
            await release.wait()

    a = asyncio.create_task(holder("a", 60))
    await asyncio.sleep(0)
    b = asyncio.create_task(holder("b", 60))  # would exceed: waits for a
    await asyncio.sleep(0.01)
    assert order == ["a"] and budget.held == 60
    release.set()
    await asyncio.gather(a, b)
    assert order == ["a", "b"] and budget.held == 0 and budget.peak == 60
    release.clear()
    big = asyncio.create_task(holder("big", 1000))  # larger than the limit: runs alone
    await asyncio.sleep(0.01)
    assert budget.held == 1000
    release.set()
    await big
    with pytest.raises(ValueError):
        ByteBudget(0)


def test_memory_releaser_is_rate_limited_and_ignores_small_encodes() -> None:
    r = MemoryReleaser()
    r.after_encode(10)
    assert r.trims == 0
    r.after_encode(10**6)
    r.after_encode(10**6)  # within TRIM_INTERVAL_S of the first
    assert r.trims == (1 if r._trim is not None else 0)


def _featurizer(**budgets: int) -> Featurizer:
    return Featurizer(
        [ModelConfig(name="tiny", tokenizer=TINY, block_size=16)],
        EncodeSettings(cache_entries=1000, threads=1, offload_chars=1000, budgets=Budgets(**budgets)),
    )


async def test_a_prompt_above_the_cap_is_refused_before_it_is_encoded() -> None:
    f = _featurizer(max_prompt_chars=5000)
    try:
        ok = request_of("chat", {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 100}]})
        await f.featurize(ok)
        big = request_of("chat", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 6000}]})
        with pytest.raises(RequestError) as exc:
            await f.featurize(big)
        assert (exc.value.status, exc.value.code, exc.value.param) == (400, "prompt_too_long", "messages")
        with pytest.raises(RequestError):
            f.featurize_sync(big)
        big_prompt = request_of("completions", {"model": "tiny", "prompt": "y" * 6000})
        with pytest.raises(RequestError) as exc:
            await f.featurize(big_prompt)
        assert exc.value.param == "prompt"
        assert f.memory_stats()["segment_cache"][0] > 0
    finally:
        await f.close()


async def test_memory_stats_report_every_holder_under_its_budget() -> None:
    cache = 200_000
    f = _featurizer(
        cache_bytes=cache, defer_backlog_bytes=50_000, inflight_bytes=30_000, checkpoint_bytes=20_000
    )
    try:
        for i in range(20):  # distinct long prompts: far more than the cache's bytes
            req = request_of("completions", {"model": "tiny", "prompt": _text(i, 8000) + "<|im_end|>"})
            await f.featurize(req)
        stats = f.memory_stats()
        assert set(stats) == {
            "segment_cache",
            "memo_cache",
            "seen_texts",
            "deferred_backlog",
            "encodes_in_flight",
            "prefix_checkpoints",
        }
        held, bound = stats["segment_cache"]
        assert 0 < held <= bound == cache
        held, bound = stats["prefix_checkpoints"]
        assert held <= bound == 20_000  # filled and bounded: test_prefix_checkpoints.py
        assert stats["encodes_in_flight"] == (0, 30_000)
        assert f.executor.inflight.peak > 0  # the long encodes went through the budget
    finally:
        await f.close()


def test_default_budgets_stay_well_under_the_chart_memory_limit() -> None:
    """The defaults' sum (bytes held by clients' text, plus ~100 bytes of transient encode memory
    a character in flight) stays under half the chart's 2 Gi limit."""
    p = parse_config({"models": [{"name": "m"}]}).proxy
    seen = p.tokenize_seen_entries * 80
    in_flight_transient = p.tokenize_inflight_bytes * 100
    total = (
        p.tokenize_cache_bytes
        + seen
        + p.tokenize_defer_backlog_bytes
        + in_flight_transient
        + p.tokenize_checkpoint_bytes
        + p.memo_cache_bytes
    )
    assert total < 1024**3, total


def test_memo_cache_is_exact_and_bounded_in_bytes() -> None:
    from gateway.features.memo_cache import ENTRY_OVERHEAD, KEY_BYTES, MemoCache
    from router_policies.block_keys import block_keys

    calls: list[int] = []

    def compute(tokens: np.ndarray) -> list[int]:
        calls.append(len(tokens))
        return block_keys(tokens, 4, "m")

    ns = ("m", None, None, 4)
    cache = MemoCache(max_bytes=(ENTRY_OVERHEAD + 8 * KEY_BYTES) * 2)
    a = np.arange(32, dtype=np.uint32)
    b = np.arange(1, 33, dtype=np.uint32)
    assert cache.keys(ns, a, compute) == block_keys(a, 4, "m")
    assert cache.keys(ns, a, compute) == block_keys(a, 4, "m") and len(calls) == 1  # a hit
    assert cache.keys(("m", "lora", None, 4), a, compute) and len(calls) == 2  # another namespace
    cache.keys(ns, b, compute)  # three entries of 8 keys: the least recently used goes
    assert cache.bytes <= cache.max_bytes and len(cache) == 2
    cache.keys(ns, a, compute)
    assert len(calls) == 4  # ``a`` in ``ns`` was the one dropped, computed again
    assert cache.text(("t", 1), lambda: "x" * 10_000) == "x" * 10_000  # larger than the bound
    assert len(cache) == 2 and cache.bytes <= cache.max_bytes  # not kept
    off = MemoCache(0)
    off.keys(ns, a, compute)
    assert len(off) == 0 and off.bytes == 0


async def test_a_chat_rendered_from_the_memo_is_the_rendering() -> None:
    f = _featurizer()
    try:
        body = {
            "model": "tiny",
            "messages": [{"role": "system", "content": "s " * 50}, {"role": "user", "content": "hi"}],
        }
        first, _ = await f.featurize(request_of("chat", body))
        hits = f.memo.hits
        again, _ = await f.featurize(request_of("chat", body))
        assert f.memo.hits >= hits + 2  # the rendering and the keys
        assert again.block_keys == first.block_keys and again.prompt_tokens == first.prompt_tokens
        other = {**body, "messages": [*body["messages"][:1], {"role": "user", "content": "ho"}]}
        third, _ = await f.featurize(request_of("chat", other))
        off = _featurizer(memo_cache_bytes=0)
        try:  # the same features without the memo
            for b, got in ((body, again), (other, third)):
                plain, _ = await off.featurize(request_of("chat", b))
                assert plain.block_keys == got.block_keys and plain.prompt_tokens == got.prompt_tokens
            assert len(off.memo) == 0 and off.memo.bytes == 0
        finally:
            await off.close()
    finally:
        await f.close()


def test_negative_bounds_are_refused_by_name() -> None:
    non_negative(a=0, b=None)
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        BoundedLRU(10, max_bytes=-1)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        BoundedLRU(-1)
    with pytest.raises(ValueError, match="backlog_bytes must be >= 0"):
        DeferredEncodes(DeferredLimits(0, -1), lambda: None)


def test_a_template_renders_once_for_the_same_inputs() -> None:
    from gateway.features.chat_template import ChatTemplate, make_environment
    from gateway.features.memo_cache import MemoCache

    memo = MemoCache(1 << 20)
    template = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", {}, make_environment(), memo
    )
    conversation = [{"role": "user", "content": "hello"}]

    def render(content: str = "hello") -> str:
        convo = [{**conversation[0], "content": content}]
        return template.render(
            convo,
            tools=None,
            documents=None,
            add_generation_prompt=True,
            continue_final_message=False,
            kwargs={},
        )

    assert render() == "<user>hello" and (memo.hits, memo.misses, len(memo)) == (0, 1, 1)
    assert render() == "<user>hello" and memo.hits == 1  # the second time from the memo
    assert render("other") == "<user>other" and (memo.misses, len(memo)) == (2, 2)
