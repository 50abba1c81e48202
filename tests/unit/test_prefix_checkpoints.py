"""Prefix checkpoints: a text starting as one encoded before gets its head's tokens from the
checkpoints of the shared blocks plus an encode of what follows them, exactly the tokens an
encode from the first character gives (byte-level, SentencePiece-style and whitespace
pre-tokenizers, odd whitespace and punctuation); a composed head its full encode contradicts
turns checkpoints off; the store is bounded in bytes."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from gateway.features.budgets import Budgets
from gateway.features.novelty import PROBE_CHARS, SeenTexts
from gateway.features.prefix_checkpoints import (
    CHECKPOINT_OVERHEAD,
    Checkpoint,
    PrefixCheckpoints,
    checkpoints_of,
    continue_head,
)
from gateway.features.tokenizer_files import load_tokenizer_files
from gateway.request import request_of
from tests.unit.test_features_deferred import SYSTEM, TINY, WORDS, _metaspace, chat, closing, make

SEED = 7
SEPARATORS = ["", " ", "  ", "\n", ", ", "...", "\t", "  \n\n", " 12", "345 ", " é", "—"]


def _whitespace() -> Tokenizer:
    """A BERT-style WordPiece (lower-cased, split on whitespace and punctuation)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(vocab_size=600, special_tokens=["[UNK]"], show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)], trainer)
    return tok


TOKENIZERS = {
    "tiny": lambda: load_tokenizer_files(Path(TINY), where="t").tokenizer,
    "metaspace": _metaspace,
    "whitespace": _whitespace,
}


def _text(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(SEPARATORS) for _ in range(pieces))


def encode_recording(
    tok: Tokenizer, text: str, fingerprints: list[int]
) -> tuple[list[int], list[tuple[int, Checkpoint]]]:
    """``text``'s ids and checkpoints, as the deferred encode of a whole text records them."""
    enc = tok.encode(text, add_special_tokens=False)
    return enc.ids, checkpoints_of(enc, (0, len(enc.ids)), 0, fingerprints)[0]


def _head(tok: Tokenizer, text: str, chars: int) -> list[int]:
    """``head_tokens``' rule on a whole text: the tokens of ``text[:chars]`` but its last two words."""
    enc = tok.encode(text[:chars], add_special_tokens=False)
    last = max((w for w in enc.word_ids if w is not None), default=-1)
    return [i for i, w in zip(enc.ids, enc.word_ids, strict=True) if w is not None and w < last - 1]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=10**6),
    shared=st.integers(min_value=0, max_value=2500),
    which=st.sampled_from(sorted(TOKENIZERS)),
)
@example(seed=737, shared=0, which="whitespace")  # the first text ends in whitespace no token covers
def test_a_composed_head_is_the_exact_head(seed: int, shared: int, which: str) -> None:
    tok = TOKENIZERS[which]()
    rng = random.Random(seed)
    first = _text(rng, 400)
    second = first[:shared] + _text(rng, 200)  # the same start, then other text (maybe mid-word)
    store = PrefixCheckpoints(1 << 20)
    ids, found = encode_recording(tok, first, SeenTexts.fingerprints(SEED, first, 0))
    # one per block through the last token's end: a tail no token covers (trailing whitespace
    # a WordPiece pre-tokenizer drops) would only repeat the checkpoint before it
    last_end = tok.encode(first, add_special_tokens=False).offsets[-1][1]
    assert len(found) == -(-last_end // PROBE_CHARS)
    store.learn(found)
    fps = SeenTexts.fingerprints(SEED, second, 0)
    seen = shared // PROBE_CHARS
    head_chars = (seen + 1) * PROBE_CHARS + 64
    known = store.known(fps[:seen])
    if known is None:  # nothing shared, or not even one whole word kept in what is
        assert shared < 2 * PROBE_CHARS
        return
    assert known.blocks == seen and known.cut <= seen * PROBE_CHARS
    assert list(known.tokens) == list(ids[: len(known.tokens)])  # exact for the first text too
    out = continue_head(tok, second, head_chars, known)
    assert out is not None, "the context word came back changed"
    head, covered = out
    assert list(head) == _head(tok, second, head_chars)
    full = tok.encode(second, add_special_tokens=False).ids
    assert list(head) == full[: len(head)]  # and a prefix of the second text's own tokens
    assert covered <= head_chars


def test_a_head_its_full_encode_contradicts_turns_checkpoints_off() -> None:
    store = PrefixCheckpoints(1 << 20)
    tok = TOKENIZERS["tiny"]()
    text = _text(random.Random(1), 300)
    fps = SeenTexts.fingerprints(SEED, text, 0)
    got, found = encode_recording(tok, text, fps)
    ids = np.asarray(got, dtype=np.uint32)
    store.learn(found)
    assert store.known(fps[:3]) is not None
    assert store.check(ids[:50], ids) and not store.disabled
    wrong = ids[:50].copy()
    wrong[10] += 1
    assert not store.check(wrong, ids)
    assert store.disabled and store.mismatches == 1 and len(store) == 0
    store.learn(found)  # nothing is learned any more
    assert store.known(fps[:3]) is None and len(store) == 0


def test_checkpoints_of_texts_that_part_after_a_block_do_not_mix() -> None:
    """Two texts sharing their first two blocks may keep different words of the second (what
    follows decides): the second text's later checkpoints follow its own cut of that block, so
    after the first text's checkpoints replace the shared ones, the chain stops there."""
    tok = TOKENIZERS["tiny"]()
    rng = random.Random(77)  # a pair whose cuts of the shared second block differ (asserted)
    first = _text(rng, 300)
    second = first[: 2 * PROBE_CHARS] + _text(rng, 300)
    fps = SeenTexts.fingerprints(SEED, second, 0)
    _, of_first = encode_recording(tok, first, SeenTexts.fingerprints(SEED, first, 0))
    ids, of_second = encode_recording(tok, second, fps)
    assert of_first[1][1].cut != of_second[1][1].cut
    store = PrefixCheckpoints(1 << 20)
    store.learn(of_second)
    whole = store.known(fps)
    assert whole is not None and whole.blocks == len(of_second)
    store.learn(of_first[:2])  # the first text's checkpoints of the shared blocks, learned later
    known = store.known(fps)
    assert known is not None and known.blocks == 2
    assert known.tokens.tolist() == ids[: len(known.tokens)]


def test_checkpoints_are_bounded_in_bytes() -> None:
    bound = 40 * 1024
    store = PrefixCheckpoints(bound)
    tok = TOKENIZERS["tiny"]()
    rng = random.Random(3)
    for i in range(30):
        text = _text(rng, 300)
        store.learn(encode_recording(tok, text, SeenTexts.fingerprints(SEED + i, text, 0))[1])
        assert store.bytes <= bound
    assert store.bytes > bound // 2 and len(store) * CHECKPOINT_OVERHEAD <= bound
    assert PrefixCheckpoints(0).known([1]) is None


async def test_a_completion_sharing_a_document_routes_on_its_exact_head_from_checkpoints() -> None:
    """Completions prompts are one piece of text: a second question about a document takes the
    document's tokens from checkpoints, with the same features as encoding it from the start."""
    doc = _text(random.Random(5), 600)
    async with closing(make(), make(budgets=Budgets(checkpoint_bytes=0))) as (fz, plain):
        for f in (fz, plain):
            await f.features("completions", {"model": "tiny", "prompt": doc + " first question?"})
            await f.deferred.drain()
        body = {"model": "tiny", "prompt": doc + " " + _text(random.Random(6), 150)}
        got, info = await fz.features("completions", body)
        want, _ = await plain.features("completions", body)
        assert fz.checkpoints.composed == 1 and plain.checkpoints.composed == 0
        assert len(fz.checkpoints) > 0 and len(plain.checkpoints) == 0  # 0 bytes: off, nothing kept
        assert list(got.block_keys) == list(want.block_keys) and len(got.block_keys) > 20
        assert info.deferred_chars > 0 and info.encoded_chars < 1200 < len(doc)  # only past the checkpoints
        await fz.deferred.drain()
        assert fz.checkpoints.mismatches == 0 and not fz.checkpoints.disabled
        assert fz.memory_stats()["prefix_checkpoints"][0] == fz.checkpoints.bytes > 0


async def test_a_chat_message_sharing_a_document_routes_on_its_exact_head_from_checkpoints() -> None:
    """A document pasted in a user message, asked about again in a new message: the message is
    one new segment, its head comes from checkpoints, with an encode's exact keys."""
    doc = _text(random.Random(9), 600)
    async with closing(make(), make(budgets=Budgets(checkpoint_bytes=0))) as (fz, plain):
        for f in (fz, plain):
            for first in ("hi", doc + " first question?"):  # the system prompt's segment cached first
                await f.features("chat", chat(SYSTEM, first))
                await f.deferred.drain()
        body = chat(SYSTEM, doc + " " + _text(random.Random(10), 150))
        seen, _ = await fz.featurize(request_of("chat", body), explain=True)  # counts nothing
        assert fz.checkpoints.composed == 0 and len(seen.block_keys) > 20
        got, _ = await fz.features("chat", body)
        want, _ = await plain.features("chat", body)
        assert fz.checkpoints.composed == 1
        assert list(got.block_keys) == list(want.block_keys) and len(got.block_keys) > 20
