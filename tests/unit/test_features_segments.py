"""Segment encoding is exact against whole-text encoding, and its cache is bounded.

Besides the committed byte-level tokenizer, small tokenizers are built here (trained offline on
the committed corpus in a fraction of a second) to reach the cases where a piece's ids depend on
its surroundings: a Metaspace pre-tokenizer that treats offset 0 specially, added tokens that
swallow neighbouring whitespace (lstrip/rstrip), single-word tokens, overlapping added tokens,
normalized added tokens and a BOS/EOS post-processor.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from gateway.features.segment_encoder import BoundedLRU, SegmentEncoder
from gateway.features.tokenizer_files import load_tokenizer_files

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "assets/tokenizers/kvgate-tiny"
CORPUS_TEXT = (ROOT / "assets/corpus/stdlib_docstrings.txt").read_text(encoding="utf-8")[:200_000]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def tiny() -> Tokenizer:
    return load_tokenizer_files(TINY, where="test").tokenizer


def metaspace_first() -> Tokenizer:
    """A SentencePiece-style BPE whose pre-tokenizer prepends '▁' only to the text's first piece."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<unk>", *SPECIALS], show_progress=False)
    tok.train_from_iterator([CORPUS_TEXT], trainer)
    return tok


def with_stripping_tokens() -> Tokenizer:
    tok = tiny()
    tok.add_tokens(
        [
            AddedToken("<mask>", lstrip=True, rstrip=False, normalized=False, special=True),
            AddedToken("<sep>", lstrip=False, rstrip=True, normalized=False, special=True),
            AddedToken("[[tool]]", normalized=True),  # matched after normalization, never a cut point
            AddedToken("<|im_start|>assistant", normalized=False, special=True),  # overlaps <|im_start|>
        ]
    )
    return tok


def encoder(tok: Tokenizer, capacity: int = 10_000) -> SegmentEncoder:
    return SegmentEncoder(tok, BoundedLRU(capacity), "t")


def texts(seed: int, n: int, tokens: list[str]) -> list[str]:
    rng = random.Random(seed)
    words = CORPUS_TEXT.split(" ")
    pieces = [*tokens, " ", "  ", "\n", "\t", "", "é", "日本語", "🚀", "x", "▁"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            parts.append(
                rng.choice(pieces) if rng.random() < 0.5 else " ".join(rng.sample(words, rng.randint(1, 6)))
            )
        out.append("".join(parts))
    return out


@pytest.mark.parametrize(
    ("make", "extra"),
    [
        (tiny, []),
        (metaspace_first, []),
        (
            with_stripping_tokens,
            ["<mask>", "<sep>", "[[tool]]", "<|im_start|>assistant", " <mask> ", " <sep> "],
        ),
    ],
)
@pytest.mark.parametrize("add_special", [False, True])
def test_segment_encoding_equals_whole_encoding(make: object, extra: list[str], add_special: bool) -> None:
    tok = make()  # type: ignore[operator]
    enc = encoder(tok)
    assert enc.splittable
    for text in texts(7, 300, SPECIALS + extra):
        want = tok.encode(text, add_special_tokens=add_special).ids
        assert enc.encode(text, add_special_tokens=add_special).tolist() == want, repr(text)
        # and again from the cache
        assert enc.encode(text, add_special_tokens=add_special).tolist() == want, repr(text)


def test_context_tokens_are_needed_for_metaspace_first() -> None:
    """Encoding the piece after a special token on its own (without the token before it) gives
    other ids: the reason segments are encoded between their neighbouring tokens."""
    tok = metaspace_first()
    text = "<|im_start|>Hello world"
    whole = tok.encode(text, add_special_tokens=False).ids
    alone = tok.encode("Hello world", add_special_tokens=False).ids
    assert whole[1:] != alone
    assert encoder(tok).encode(text, add_special_tokens=False).tolist() == whole


def test_context_tokens_are_needed_for_lstrip() -> None:
    tok = with_stripping_tokens()
    text = "a b   <mask>c"
    whole = tok.encode(text, add_special_tokens=False).ids
    naive = [
        *tok.encode("a b   ", add_special_tokens=False).ids,
        tok.token_to_id("<mask>"),
        *tok.encode("c").ids,
    ]
    assert naive != whole
    assert encoder(tok).encode(text, add_special_tokens=False).tolist() == whole


def test_single_word_tokens_disable_splitting_and_stay_exact() -> None:
    tok = tiny()
    tok.add_tokens([AddedToken("word", single_word=True, normalized=False)])
    enc = encoder(tok)
    assert not enc.splittable
    for text in texts(3, 100, [*SPECIALS, "word", " word ", "sword"]):
        assert (
            enc.encode(text, add_special_tokens=False).tolist()
            == tok.encode(text, add_special_tokens=False).ids
        )


def test_post_processor_affixes() -> None:
    tok = tiny()
    bos, eos = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A:0 <|endoftext|>",
        pair="<|im_start|> $A:0 $B:1",
        special_tokens=[("<|im_start|>", bos), ("<|endoftext|>", eos)],
    )
    enc = encoder(tok)
    # the prefix and suffix are learned (the empty text alone allows any split of them), so texts
    # with the post-processor's tokens are still cut into cached segments
    assert enc.can_cut_whole(True) and enc.plan("a<|im_end|>b", add_special_tokens=True).whole is None
    for text in ["", "abc", "<|im_end|>x<|im_start|>", *texts(5, 50, SPECIALS)]:
        assert enc.encode(text, add_special_tokens=True).tolist() == tok.encode(text).ids
        assert (
            enc.encode(text, add_special_tokens=False).tolist()
            == tok.encode(text, add_special_tokens=False).ids
        )


def test_a_bos_alone_is_learned_as_a_prefix() -> None:
    tok = tiny()
    bos = tok.token_to_id("<|im_start|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A:0", special_tokens=[("<|im_start|>", bos)]
    )
    enc = encoder(tok)
    assert enc.can_cut_whole(True) and enc.plan("a<|im_end|>b", add_special_tokens=True).whole is None
    for text in ["", "abc", "<|im_end|>x<|im_start|>", *texts(6, 50, SPECIALS)]:
        assert enc.encode(text, add_special_tokens=True).tolist() == tok.encode(text).ids


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from([*SPECIALS, " ", "\n", "  ", "\r\n", "<|im", "_end|>", "<", "|>"]),
            st.text(max_size=12),
        ),
        max_size=16,
    )
)
def test_random_texts_are_exact(pieces: list[str]) -> None:
    text = "".join(pieces)
    tok = TINY_TOK
    assert (
        ENC.encode(text, add_special_tokens=False).tolist() == tok.encode(text, add_special_tokens=False).ids
    )


TINY_TOK = tiny()
ENC = encoder(TINY_TOK, capacity=64)


def test_cache_is_bounded_by_its_capacity() -> None:
    tok = tiny()
    enc = encoder(tok, capacity=16)
    for i in range(200):
        text = f"<|im_start|>user\nmessage number {i}<|im_end|>\n<|im_start|>assistant\n"
        assert (
            enc.encode(text, add_special_tokens=False).tolist()
            == tok.encode(text, add_special_tokens=False).ids
        )
        assert len(enc.cache) <= 16
    assert len(enc.cache) == 16
    assert enc.cache.evictions > 0


def test_cache_capacity_zero_caches_nothing_and_stays_exact() -> None:
    tok = tiny()
    enc = encoder(tok, capacity=0)
    text = "<|im_start|>user\nhi<|im_end|>\n"
    for _ in range(3):
        assert (
            enc.encode(text, add_special_tokens=False).tolist()
            == tok.encode(text, add_special_tokens=False).ids
        )
    assert len(enc.cache) == 0 and enc.cache.hits == 0


def test_lru_keeps_recently_used_entries() -> None:
    lru = BoundedLRU(2)
    import numpy as np

    a = np.zeros(1, dtype=np.uint32)
    lru.put(("t", "", "a", ""), a)
    lru.put(("t", "", "b", ""), a)
    assert lru.get(("t", "", "a", "")) is not None  # a is now the most recent
    lru.put(("t", "", "c", ""), a)
    assert lru.get(("t", "", "b", "")) is None
    assert lru.get(("t", "", "a", "")) is not None and lru.get(("t", "", "c", "")) is not None
    with pytest.raises(ValueError):
        BoundedLRU(-1)


def test_resent_transcript_encodes_only_the_new_message() -> None:
    tok = tiny()
    enc = encoder(tok)
    history = "<|im_start|>system\nBe brief.<|im_end|>\n"
    for turn in range(6):
        history += f"<|im_start|>user\nquestion {turn} " + "lorem ipsum " * 20 + "<|im_end|>\n"
        plan = enc.plan(history + "<|im_start|>assistant\n", add_special_tokens=False)
        if turn > 0:
            # the whole history came from the cache; only the new message and its tail are encoded
            assert len(plan.missing) <= 3
        done = enc.encode_missing(plan, add_special_tokens=False)
        ids = enc.finish(plan, done, add_special_tokens=False)
        assert ids.tolist() == tok.encode(history + "<|im_start|>assistant\n", add_special_tokens=False).ids
        history += f"<|im_start|>assistant\nanswer {turn}<|im_end|>\n"


def test_transformers_tokenizer_loading_adjustments(tmp_path: Path) -> None:
    """Special tokens of the config become added tokens (even ones the vocabulary lacks) and
    ``add_bos_token`` is ignored beside a tokenizer.json, as PreTrainedTokenizerFast does; checked
    against transformers itself."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((TINY / "tokenizer.json").read_text())
    cfg = json.loads((TINY / "tokenizer_config.json").read_text())
    cfg.update({"bos_token": "<s>", "add_bos_token": True, "additional_special_tokens": ["<tool>"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    files = load_tokenizer_files(folder, where="test")
    ref = PreTrainedTokenizerFast.from_pretrained(str(folder))
    enc = encoder(files.tokenizer)
    for text in [
        "hello <s> world",
        "<tool>x</tool>",
        "plain",
        "",
        *texts(11, 40, [*SPECIALS, "<s>", "<tool>"]),
    ]:
        want = ref(text, add_special_tokens=True)["input_ids"]
        assert enc.encode(text, add_special_tokens=True).tolist() == want, repr(text)
        want = ref(text, add_special_tokens=False)["input_ids"]
        assert enc.encode(text, add_special_tokens=False).tolist() == want, repr(text)
    assert files.special_tokens["bos_token"] == "<s>"


def test_the_segment_encoder_calls_the_tokenizer_through_encode_calls_only() -> None:
    """Which call an encode makes depends on its thread (``encode_calls``: ``encode_batch``, which
    releases the GIL, off the event loop's thread; ``encode`` on it). Outside the constructor's
    probes, the segment encoder and the checkpoints never call the tokenizer themselves."""
    import ast
    import inspect

    from gateway.features import prefix_checkpoints, segment_encoder

    offenders = []
    for source in (inspect.getsource(segment_encoder.SegmentEncoder), inspect.getsource(prefix_checkpoints)):
        for fn in ast.walk(ast.parse(source)):
            if isinstance(fn, ast.FunctionDef) and fn.name not in ("__init__", "_probe_affixes"):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Attribute) and node.attr in ("encode", "encode_batch"):
                        offenders.append(f"{fn.name}:{node.lineno}")
    assert not offenders, offenders
