"""Exact, cached encoding of text in segments between added tokens.

Why this is exact. ``tokenizers`` first cuts the text at added tokens that match on the raw text
(``normalized=False``), then normalizes, pre-tokenizes and BPE-encodes each remaining piece on its
own; merges never cross an added token. So the ids of a text are the ids of its pieces with the
added tokens' ids between them. Two things let a piece depend on its surroundings: an added
token's ``lstrip``/``rstrip`` swallows whitespace at the edge of its neighbours, and some
pre-tokenizers treat the piece at offset 0 differently (Metaspace ``prepend_scheme="first"``).
Both are kept intact by encoding each segment *with* the added token before and after it
(``prev + segment + next``) and dropping those two ids: the segment then sits at the same
offset, between the same tokens, as in the whole text. The cache key is that triple.

We cut only where ``tokenizers`` cuts: at matches of the non-normalized added tokens, found
leftmost-longest like its matcher (a regex alternation ordered longest first). Tokens with
``single_word`` make matching depend on neighbouring characters in ways we do not model, so a
tokenizer that has one is never split (every text is encoded whole; still exact, only slower).
With ``encode_special_tokens`` on, special tokens are text, not cut points.

``add_special_tokens=True`` adds the post-processor's tokens (BOS/EOS...). We learn them once as a
fixed prefix and suffix by probing, and check the probe is consistent; if it is not, such
encodes are done whole.

Threading: ``plan`` and ``finish`` touch the cache and run on the event loop thread only;
``encode_missing`` is pure (the tokenizer is read-only) and may run in a worker thread.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import xxhash
from tokenizers import Encoding, Tokenizer

from gateway.features.budgets import SEGMENT_ENTRY_OVERHEAD, text_bytes
from gateway.features.byte_lru import ByteLRU
from gateway.features.encode_calls import encode_many, encode_one

TokenArray = npt.NDArray[np.uint32]
SegmentKey = tuple[str, str, str, str]  # (tokenizer, token before or "", segment text, token after or "")

_EMPTY: TokenArray = np.zeros(0, dtype=np.uint32)
# the first missing piece's encoding, where its own tokens are, where its characters start
FirstPiece = Callable[[Encoding, tuple[int, int], int], None]


def kept_before_cut(words: Sequence[int | None], lo: int) -> int:
    """Where the exact tokens of a cut text end (``head_tokens``' rule, also
    ``prefix_checkpoints.continue_head``'s): from token ``lo`` on, those of every word before the
    text's last two (the last may be cut; the one before it is the margin for pre-tokenizers that
    look ahead), stopping at a token of no word."""
    last = max((w for w in words[lo:] if w is not None), default=-1)
    n = lo
    while n < len(words) and (w := words[n]) is not None and w < last - 1:
        n += 1
    return n


class BoundedLRU(ByteLRU[SegmentKey, TokenArray]):
    """The segment cache: segments' token ids by (namespace, context, text, context), bounded in
    entries and in bytes of texts and token ids (byte_lru.py)."""

    def __init__(self, capacity: int, max_bytes: int | None = None) -> None:
        super().__init__(capacity, max_bytes, BoundedLRU.entry_bytes)

    @staticmethod
    def entry_bytes(key: SegmentKey, value: TokenArray) -> int:
        return text_bytes(key[2]) + value.nbytes + SEGMENT_ENTRY_OVERHEAD


@dataclass
class EncodePlan:
    """One text cut into segments; ``parts`` alternates cached arrays and slots to fill."""

    keys: list[SegmentKey]
    found: list[TokenArray | None]  # per segment: cached ids, or None to encode
    separators: list[str]  # the added tokens between segments (len(keys) - 1)
    missing: list[int] = field(default_factory=list)  # indexes into keys
    empty: int = 0  # segments with no text (two added tokens side by side)
    whole: str | None = None  # set when the text is encoded in one piece

    @property
    def missing_chars(self) -> int:
        if self.whole is not None:
            return len(self.whole)
        return sum(len(self.keys[i][2]) for i in self.missing)

    @property
    def segments(self) -> int:
        """Non-empty segments (the whole text counts as one)."""
        return 1 if self.whole is not None else len(self.keys) - self.empty

    @property
    def cached_segments(self) -> int:
        return 0 if self.whole is not None else len(self.keys) - self.empty - len(self.missing)

    def first_text(self) -> str:
        """The text encoded first: the whole text, or the first missing segment."""
        return self.whole if self.whole is not None else self.keys[self.missing[0]][2]

    def first_after(self) -> str:
        """The added token after the text encoded first ("" for a whole text or none)."""
        return "" if self.whole is not None else self.keys[self.missing[0]][3]

    def start_of(self, i: int) -> int:
        """Character offset of segment ``i`` in the planned text."""
        return sum(len(k[2]) for k in self.keys[:i]) + sum(len(sep) for sep in self.separators[:i])

    def head(self) -> EncodePlan | None:
        """A copy that encodes only the missing segments before the last one: the text's leading
        new part, the part other requests can share (a new system prompt, a document, an unseen
        conversation's earlier turns); None with fewer than two missing (or one piece)."""
        if self.whole is not None or len(self.missing) < 2:
            return None
        return self._encoding_only(self.missing[:-1])

    def leading(self, end: int, overlap: int) -> EncodePlan | None:
        """A copy that encodes only the missing segments lying in the text's first ``end``
        characters (each with at least ``overlap`` of its characters there, or all of them); None
        when that is none or every missing segment (or the text is one piece)."""
        if self.whole is not None:
            return None
        keep = []
        for i in self.missing:  # in text order: what is kept is a leading run of them
            start = self.start_of(i)
            if start + min(len(self.keys[i][2]), overlap) > end:
                break
            keep.append(i)
        if not keep or len(keep) == len(self.missing):
            return None
        return self._encoding_only(keep)

    def _encoding_only(self, missing: list[int]) -> EncodePlan:
        """A copy of this plan that encodes the segments ``missing`` (a leading run of its own)."""
        return EncodePlan(self.keys, list(self.found), self.separators, missing, self.empty)


class SegmentEncoder:
    def __init__(self, tokenizer: Tokenizer, cache: BoundedLRU, namespace: str) -> None:
        """``cache`` may be shared by several encoders; ``namespace`` (the tokenizer's identity)
        keeps their entries apart."""
        self.tokenizer = tokenizer
        self.cache = cache
        self.namespace = namespace
        self.seed = xxhash.xxh3_64_intdigest(namespace.encode("utf-8", "surrogatepass"))
        added = tokenizer.get_added_tokens_decoder()
        raw_tokens = [
            t
            for t in added.values()
            if not t.normalized and not (tokenizer.encode_special_tokens and t.special)
        ]
        self.splittable = bool(raw_tokens) and not any(t.single_word for t in raw_tokens)
        self._ids: dict[str, int] = {t.content: i for i, t in added.items()}
        self._id_arrays = {c: np.asarray([i], dtype=np.uint32) for c, i in self._ids.items()}
        contents = sorted({t.content for t in raw_tokens}, key=lambda c: (-len(c), c))
        self._pattern: re.Pattern[str] | None = (
            re.compile("(" + "|".join(re.escape(c) for c in contents) + ")") if self.splittable else None
        )
        self._affixes = self._probe_affixes()
        # characters and tokens of every encode so far, to estimate the tokens of text routed
        # before it is encoded (prior: 4 characters a token, weighing as 4,096 characters)
        self.chars_seen = 4096
        self.tokens_seen = 1024

    def _probe_affixes(self) -> tuple[TokenArray, TokenArray] | None:
        """(prefix, suffix) the post-processor adds with ``add_special_tokens=True``, or None
        when it is not a fixed prefix/suffix."""
        # the splits every probe allows (the empty probe allows any: a BOS could be a suffix)
        found: set[tuple[tuple[int, ...], tuple[int, ...]]] | None = None
        for probe in ("", "a", "Hello world. 123", " x\n y"):
            plain = self.tokenizer.encode(probe, add_special_tokens=False).ids
            full = self.tokenizer.encode(probe, add_special_tokens=True).ids
            n = len(plain)
            candidates = {
                (tuple(full[:i]), tuple(full[i + n :]))
                for i in range(len(full) - n + 1)
                if full[i : i + n] == plain
            }
            found = candidates if found is None else found & candidates
            if not found:
                return None
        if found is None or len(found) != 1:
            return None
        pre, post = found.pop()
        return np.asarray(pre, dtype=np.uint32), np.asarray(post, dtype=np.uint32)

    # -- planning (event loop thread) --------------------------------------------------------

    def plan(self, text: str, *, add_special_tokens: bool, peek: bool = False) -> EncodePlan:
        """The segments of ``text`` and which of them the cache holds. ``peek``: without counting
        hits and misses or refreshing entries (``/admin/explain`` changes nothing)."""
        if self._pattern is None or (add_special_tokens and self._affixes is None):
            return EncodePlan(keys=[], found=[], separators=[], whole=text)
        ns = self.namespace
        # split with a capturing group alternates [segment, token, segment, token, ..., segment]
        pieces = self._pattern.split(text)
        separators: list[str] = pieces[1::2]
        segments = pieces[0::2]
        befores = ["", *separators]
        afters = [*separators, ""]
        keys: list[SegmentKey] = [
            (ns, b, seg, a) for b, seg, a in zip(befores, segments, afters, strict=True)
        ]
        found: list[TokenArray | None] = []
        missing: list[int] = []
        empty = 0
        for i, key in enumerate(keys):
            if not key[2]:
                found.append(_EMPTY)
                empty += 1
                continue
            hit = self.cache.peek(key) if peek else self.cache.get(key)
            found.append(hit)
            if hit is None:
                missing.append(i)
        return EncodePlan(keys=keys, found=found, separators=separators, missing=missing, empty=empty)

    def _learn(self, plan: EncodePlan, encoded: Sequence[TokenArray]) -> None:
        self.chars_seen += plan.missing_chars
        self.tokens_seen += sum(len(ids) for ids in encoded)

    def estimate_tokens(self, chars: int) -> int:
        return round(chars * self.tokens_seen / self.chars_seen)

    def prefix_tokens(self, plan: EncodePlan, *, add_special_tokens: bool) -> TokenArray:
        """The exact leading tokens of a planned text, up to its first segment to encode: the
        cached segments before it and the added tokens after each (a prompt's tokens only depend
        on what precedes them within these, see the module docstring)."""
        parts: list[TokenArray] = []
        if add_special_tokens and self._affixes is not None:
            parts.append(self._affixes[0])
        if plan.whole is None:
            stop = plan.missing[0] if plan.missing else len(plan.keys)
            for i in range(stop):
                seg = plan.found[i]
                assert seg is not None
                parts.append(seg)
                if i < len(plan.separators):
                    parts.append(self._id_arrays[plan.separators[i]])
        return np.concatenate(parts) if parts else _EMPTY

    def can_cut_whole(self, add_special_tokens: bool) -> bool:
        """Whether a whole-text plan's leading tokens are known without encoding it all (the
        post-processor's prefix is known, or none is added)."""
        return not add_special_tokens or self._affixes is not None

    def head_tokens(self, plan: EncodePlan, chars: int) -> tuple[TokenArray, int]:
        """The exact leading tokens of the plan's first segment to encode, from encoding only its
        first ``chars`` characters; and how many characters they cover.

        Encoding a cut text is exact up to the pre-tokenizer's words that end before the cut: a
        word is split off the text by its own characters and at most one after it (the
        pre-tokenizers' lookahead), and BPE never merges across words. So the tokens of the cut
        text's last word are dropped, and those of the word before it as a margin for splitting
        rules that look further ahead (a property test checks byte-level and SentencePiece-style
        pre-tokenizers). A tokenizer without a pre-tokenizer has one word, and nothing is kept
        (the request is then routed on less of its prefix, never wrongly). Pure: any thread."""
        if plan.whole is not None:
            prev, text = "", plan.whole[:chars]
        else:
            _, prev, seg, _ = plan.keys[plan.missing[0]]
            text = prev + seg[:chars]
        enc = encode_one(self.tokenizer, text, add_special_tokens=False)
        ids, words, offsets = enc.ids, enc.word_ids, enc.offsets
        lo = 0
        if prev:
            if not ids or ids[0] != self._ids[prev]:
                raise AssertionError(f"segment context token changed while encoding {prev!r}")
            lo = 1
        n = kept_before_cut(words, lo)
        covered = offsets[n - 1][1] - len(prev) if n > lo else 0
        return np.asarray(ids[lo:n], dtype=np.uint32), covered

    def remember(self, plan: EncodePlan, encoded: Sequence[TokenArray]) -> None:
        """Put encoded segments in the cache (event loop thread)."""
        self._learn(plan, encoded)
        if plan.whole is not None:
            return
        for i, ids in zip(plan.missing, encoded, strict=True):
            plan.found[i] = ids
            self.cache.put(plan.keys[i], ids)

    def still_missing(self, plan: EncodePlan) -> EncodePlan:
        """A copy of ``plan`` whose segments cached since it was made (by another request) are
        filled in from the cache, and only the others left to encode."""
        if plan.whole is not None:
            return plan
        found = list(plan.found)
        missing = []
        for i in plan.missing:
            hit = self.cache.peek(plan.keys[i])
            if hit is None:
                missing.append(i)
            else:
                found[i] = hit
        return EncodePlan(
            keys=plan.keys, found=found, separators=plan.separators, missing=missing, empty=plan.empty
        )

    # -- encoding (any thread) -----------------------------------------------------------------

    def encode_missing(
        self,
        plan: EncodePlan,
        *,
        add_special_tokens: bool,
        on_first: FirstPiece | None = None,
        first: TokenArray | None = None,
    ) -> list[TokenArray]:
        """The missing segments' ids (the whole text's for a whole plan). ``on_first(encoding,
        (lo, hi), shift)``: called with the first one's encoding, where its own tokens are
        (the rest are context or the post-processor's) and where its characters start.
        ``first``: the first one's own ids, known already (a resumed encode): not encoded."""
        if first is not None:
            if plan.whole is not None:
                if not add_special_tokens:
                    return [first]
                assert self._affixes is not None  # (can_cut_whole)
                return [np.concatenate([self._affixes[0], first, self._affixes[1]])]
            rest = EncodePlan(plan.keys, plan.found, plan.separators, plan.missing[1:], plan.empty)
            return [first, *self.encode_missing(rest, add_special_tokens=add_special_tokens)]
        if plan.whole is not None:
            # the GIL released off the event loop's thread, kept on it (encode_calls)
            enc = encode_one(self.tokenizer, plan.whole, add_special_tokens=add_special_tokens)
            whole = enc.ids
            if on_first is not None:
                pre, post = (
                    self._affixes if add_special_tokens and self._affixes is not None else (_EMPTY, _EMPTY)
                )
                on_first(enc, (len(pre), len(whole) - len(post)), 0)
            return [np.asarray(whole, dtype=np.uint32)]
        if not plan.missing:
            return []
        texts = [plan.keys[i][1] + plan.keys[i][2] + plan.keys[i][3] for i in plan.missing]
        out: list[TokenArray] = []
        for i, enc in zip(
            plan.missing, encode_many(self.tokenizer, texts, add_special_tokens=False), strict=True
        ):
            _, prev, _, nxt = plan.keys[i]
            ids = enc.ids
            lo = 1 if prev else 0
            hi = len(ids) - (1 if nxt else 0)
            # the context tokens must come back as themselves, or the cut was not where
            # tokenizers cuts; that would be a bug, never silently wrong ids
            if (prev and (not ids or ids[0] != self._ids[prev])) or (
                nxt and (not ids or ids[-1] != self._ids[nxt])
            ):
                raise AssertionError(f"segment context tokens changed while encoding {plan.keys[i]!r}")
            if on_first is not None and not out:
                on_first(enc, (lo, hi), len(prev))
            out.append(np.asarray(ids[lo:hi], dtype=np.uint32))
        return out

    # -- assembling (event loop thread) --------------------------------------------------------

    def finish(
        self,
        plan: EncodePlan,
        encoded: Sequence[TokenArray],
        *,
        add_special_tokens: bool,
        record: bool = True,
    ) -> TokenArray:
        """The prompt's tokens from ``plan`` and its ``encoded`` segments; ``record``: also cache
        the segments and learn the characters-per-token ratio (False: no side effect)."""
        if plan.whole is not None:
            if record:
                self._learn(plan, encoded)
            return encoded[0]
        found = plan.found
        if record:
            self.remember(plan, encoded)
        else:
            found = list(found)
            for i, ids in zip(plan.missing, encoded, strict=True):
                found[i] = ids
        parts: list[TokenArray] = []
        if add_special_tokens and self._affixes is not None:
            parts.append(self._affixes[0])
        for i, seg in enumerate(found):
            assert seg is not None
            parts.append(seg)
            if i < len(plan.separators):
                parts.append(self._id_arrays[plan.separators[i]])
        if add_special_tokens and self._affixes is not None:
            parts.append(self._affixes[1])
        return np.concatenate(parts) if parts else _EMPTY

    def encode(self, text: str, *, add_special_tokens: bool) -> TokenArray:
        """Plan, encode and assemble on the calling thread."""
        plan = self.plan(text, add_special_tokens=add_special_tokens)
        return self.finish(
            plan,
            self.encode_missing(plan, add_special_tokens=add_special_tokens),
            add_special_tokens=add_special_tokens,
        )
