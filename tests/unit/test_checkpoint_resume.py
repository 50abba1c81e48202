"""A deferred encode resumed after prefix checkpoints: a text whose head was composed from the
checkpoints of blocks seen before is encoded only from their context word on, and gets exactly
the tokens, and records exactly the checkpoints of its later blocks, that an encode from the
first character gives; one such job in ``CHECK_EVERY`` still encodes whole and checks the head."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, Literal, cast

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import processors

from gateway.features.budgets import DeferredLimits, text_bytes
from gateway.features.deferred import CHECK_EVERY, DeferredEncodes
from gateway.features.feature_info import keys_after, keys_of
from gateway.features.featurizer import Featurizer
from gateway.features.novelty import PROBE_CHARS, SeenTexts
from gateway.features.prefix_checkpoints import (
    Checkpoint,
    PrefixCheckpoints,
    checkpoints_of,
    resume,
    resume_missing,
)
from gateway.features.prompt import PromptSpec
from gateway.features.segment_encoder import BoundedLRU, SegmentEncoder
from tests.unit.test_features_deferred import SYSTEM, chat, closing, make
from tests.unit.test_prefix_checkpoints import SEED, TOKENIZERS, _text, encode_recording


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=10**6),
    shared=st.integers(min_value=2 * PROBE_CHARS, max_value=2500),
    which=st.sampled_from(sorted(TOKENIZERS)),
)
@example(seed=737, shared=2 * PROBE_CHARS, which="whitespace")
def test_a_resumed_encode_is_the_whole_encode(seed: int, shared: int, which: str) -> None:
    tok = TOKENIZERS[which]()
    rng = random.Random(seed)
    first = _text(rng, 400)
    second = first[:shared] + _text(rng, 200)
    store = PrefixCheckpoints(1 << 20)
    store.learn(encode_recording(tok, first, SeenTexts.fingerprints(SEED, first, 0))[1])
    fps = SeenTexts.fingerprints(SEED, second, 0)
    known = store.known(fps[: shared // PROBE_CHARS])
    if known is None:  # not even one whole word kept in the shared blocks
        return
    out = resume(tok, second, "", known)
    assert out is not None, "the context word came back changed"
    tokens, enc, hi = out
    want, want_found = encode_recording(tok, second, fps)
    assert tokens.tolist() == want
    # the blocks after the checkpoints' get checkpoints that continue their chain exactly...
    found, _ = checkpoints_of(enc, (0, hi), -known.ctx_start, fps, known)
    assert len(found) == len(want_found) - known.blocks > 0
    store.learn(found)
    through = store.known(fps)
    assert through is not None and through.blocks == len(want_found)
    assert through.tokens.tolist() == want[: len(through.tokens)]
    # ...those a whole encode records, where the first text cut the shared blocks as it does
    if want_found[known.blocks - 1][1].cut == known.cut:
        assert _plain(found) == _plain(want_found[known.blocks :])


def _plain(found: list[tuple[int, Checkpoint]]) -> list[tuple[int, int, int, int, list[int], int]]:
    return [(fp, c.cut, c.ctx_start, c.ctx_tokens, c.delta.tolist(), c.after) for fp, c in found]


def test_a_changed_context_word_or_a_missing_closing_token_is_refused() -> None:
    tok = TOKENIZERS["tiny"]()
    text = _text(random.Random(4), 300)
    fps = SeenTexts.fingerprints(SEED, text, 0)
    store = PrefixCheckpoints(1 << 20)
    store.learn(encode_recording(tok, text, fps)[1])
    known = store.known(fps[:4])
    assert known is not None and resume(tok, text, "", known) is not None
    # the context word's first character changed: its tokens (or their end) differ
    changed = text[: known.ctx_start] + "Q" + text[known.ctx_start + 1 :]
    assert resume(tok, changed, "", known) is None
    # a segment's closing added token must come back as itself
    assert resume(tok, text, "<|im_start|>", known) is not None
    assert resume(tok, text, "not an added token", known) is None


Endpoint = Literal["completions", "chat"]


def _completion(doc: str, question: str) -> tuple[Endpoint, dict[str, Any]]:
    return "completions", {"model": "tiny", "prompt": doc + " " + question}


def _chat(doc: str, question: str) -> tuple[Endpoint, dict[str, Any]]:
    return "chat", chat(SYSTEM, doc + " " + question)


async def _keys_of_deferred(fz: Featurizer, endpoint: Endpoint, body: dict[str, Any]) -> list[int]:
    """The whole prompt's keys its deferred encode reports (``on_keys``, as to the router)."""
    got: list[list[int]] = []
    _, info = await fz.features(endpoint, body)
    job = info.deferred
    assert job is not None
    if job.known is not None:  # the head kept to resume, once (known's tokens are a view of it)
        head = job.head_check
        assert head is not None and np.shares_memory(job.known.tokens, head)
        text = sum(
            text_bytes(t) for t in ([job.plan.whole] if job.plan.whole else [k[2] for k in job.plan.keys])
        )
        assert job.bytes == text + head.nbytes
    job.on_keys = got.append
    await fz.deferred.drain()
    assert len(got) == 1
    return got[0]


async def test_deferred_encodes_resume_after_the_checkpoints_their_heads_came_from() -> None:
    """Questions about one document: each one's head is composed from the document's checkpoints,
    and its deferred encode, resumed after them (all but the first and the ``CHECK_EVERY``-th
    after it, encoded whole), reports the keys an exact encode gives; a question extended later
    finds checkpoints through its own text, learned from the resumed encode."""
    for request in (_completion, _chat):
        doc = _text(random.Random(5), 600)
        async with closing(make(), make(defer_chars=0)) as (fz, exact):
            await fz.features("chat", chat(SYSTEM, "hi"))  # the system prompt's segment cached
            first = request(doc, "first question?")
            await fz.features(*first)
            await fz.deferred.drain()  # the document's checkpoints, from its whole encode
            asked = CHECK_EVERY + 2
            for i in range(asked):
                endpoint, body = request(doc, _text(random.Random(100 + i), 150))
                keys = await _keys_of_deferred(fz, endpoint, body)
                want, _ = await exact.features(endpoint, body)
                assert keys == list(want.block_keys) and len(keys) > 100
            cps = fz.checkpoints
            assert cps.composed == asked and cps.mismatches == 0 and not cps.disabled
            assert fz.cache_stats()["deferred_resumed"] == asked - 2  # the 1st and 17th: whole
            # the last question again with more text: its head's checkpoints reach through the
            # question (learned from its resumed encode), so only the new text's first block and
            # the margin are encoded before routing, not the question again
            endpoint, body = request(
                doc, _text(random.Random(100 + asked - 1), 150) + " " + _text(random.Random(7), 200)
            )
            _, info = await fz.features(endpoint, body)
            assert 0 < info.encoded_chars < 2 * PROBE_CHARS + 64 and info.deferred_chars > 0


def test_a_deferred_prompts_keys_reuse_its_heads_only_for_the_same_leading_blocks() -> None:
    """``keys_after``: the keys of every sequence are ``keys_of``'s, whether it starts with the
    head's full blocks (those keys reused, the rest chained) or not."""
    config = SimpleNamespace(block_size=16, name="m")
    spec = cast(
        PromptSpec,
        SimpleNamespace(resolved=SimpleNamespace(model=SimpleNamespace(config=config), lora=None), salt="s"),
    )
    rng = np.random.default_rng(3)
    whole = keys_of(spec)
    for head_len in (0, 15, 16, 40, 64):
        head = rng.integers(0, 50_000, head_len, dtype=np.uint32)
        keys = keys_after(spec, head, whole(head))
        same = np.concatenate([head, rng.integers(0, 50_000, 100, dtype=np.uint32)])
        other = same.copy()
        other[min(3, len(other) - 1)] += 1  # differs within the head's first block
        for tokens in (same, other, head, head[:10], same[: head_len // 16 * 16]):
            assert keys(tokens) == whole(tokens)


def test_a_whole_text_resumed_with_the_post_processors_tokens_is_its_whole_encode() -> None:
    """A tokenizer whose texts are encoded whole (no added token cuts them) and whose
    post-processor adds a BOS: a resumed encode returns the ids ``encode_missing`` gives, BOS
    included."""
    tok = TOKENIZERS["whitespace"]()
    tok.add_special_tokens(["[BOS]"])
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", tok.token_to_id("[BOS]"))]
    )
    tok.encode_special_tokens = True  # special tokens are text: nothing cuts a text
    enc = SegmentEncoder(tok, BoundedLRU(100), "t")
    rng = random.Random(11)
    first = _text(rng, 400)
    second = first[:1500] + _text(rng, 200)
    fps = SeenTexts.fingerprints(SEED, first, 0)
    learned: list[list[tuple[int, Checkpoint]]] = []
    whole = enc.plan(first, add_special_tokens=True)
    assert whole.whole is not None
    enc.encode_missing(
        whole,
        add_special_tokens=True,
        on_first=lambda e, span, shift: learned.append(checkpoints_of(e, span, shift, fps)[0]),
    )
    store = PrefixCheckpoints(1 << 20)
    store.learn(learned[0])
    known = store.known(SeenTexts.fingerprints(SEED, second, 0)[: 1500 // PROBE_CHARS])
    assert known is not None and known.blocks == 1500 // PROBE_CHARS
    plan = enc.plan(second, add_special_tokens=True)
    got = resume_missing(enc, plan, known, True, None)
    want = enc.encode_missing(plan, add_special_tokens=True)
    assert got is not None and [g.tolist() for g in got] == [w.tolist() for w in want]
    assert want[0][0] == tok.token_to_id("[BOS]")


def test_each_tokenizers_first_head_from_checkpoints_and_every_sixteenth_are_checked() -> None:
    """The whole encodes that check composed heads are counted per tokenizer: a second model's
    tokenizer has its own first head checked, however many heads the first one had."""
    deferred = DeferredEncodes(DeferredLimits(1000), lambda: None)
    order = ["a", "a", "b"] + ["a"] * (CHECK_EVERY - 1) + ["b"]
    resumes = [deferred._resume_next(ns) for ns in order]
    checked = [i for i, r in enumerate(resumes) if not r]
    assert checked == [0, 2, CHECK_EVERY + 1]  # a's 1st, b's 1st, a's 17th (b's 2nd resumes)
