"""Exact leading tokens of texts encoded before, so that a text sharing their start is not encoded
from its first character again (docs/architecture.md, "Request path": features).

A prompt sent as one piece of text (``/v1/completions``, or a chat message too long to be cut at
added tokens) has no segment to cache: a request whose text starts with what an earlier one sent
(a document asked about again, an agent's transcript resent with one more turn) used to encode
all of that shared start before routing (``EncodePlanner``'s head), ~0.15 ms per 1,000
characters on the event loop, every time.

A checkpoint is kept per ``PROBE_CHARS`` block of a text that was encoded whole, keyed by the
block's chained fingerprint (``SeenTexts.fingerprints``: it covers the text from its first
character to the end of the block, seeded per tokenizer):

    cut_j      = characters covered by the exact tokens through block j: the text's tokens up to
                 the word before the one holding block j's last character (``head_tokens``' rule:
                 a word's tokens depend on its own characters and one after them, so the tokens
                 of every word ending two words before a cut are those of any text sharing the
                 characters before the cut)
    delta_j    = those tokens after cut_(j-1)
    ctx_j      = where the last of those words starts, and its token count

A text whose first J blocks have checkpoints gets its tokens through cut_(J-1) from them, then
encodes only from ctx_(J-1) on: the last kept word is encoded again as context, and the
continuation is taken only when that word comes back as the same tokens ending at the same
character (a pre-tokenizer splits a text at the same places from any of its split points on; what
a tokenizer does at a text's first character, such as adding a prefix space, is confined to that
context word, and a changed context word is refused, never used).

Two texts sharing block j may keep different words of it (the words after the block decide
where the margin falls), so each checkpoint records the cut its delta follows (``after``) and a
run of checkpoints stops at one that follows another cut: checkpoints learned from different
texts never compose a head with a token missing or repeated.

The text's deferred encode then resumes after the same checkpoints (``resume``: from the
context word to the text's end, under the same check) and records the checkpoints of its later
blocks (``checkpoints_of(..., after=...)``), so a text resent with more at its end is never
encoded from its first character again. One such encode in ``deferred.CHECK_EVERY`` per tokenizer
(its first included) encodes the whole text instead and checks the composed head against it: a difference
disables checkpoints for good (``disabled``), logged and counted, and routing goes back to
encoding from the start.

Bounded in bytes (``proxy.tokenize_checkpoint_bytes``); an evicted checkpoint only shortens the
run of blocks found (the rest is encoded, as before). Event-loop thread only, but the pure
functions (``checkpoints_of``, ``continue_head``) run on any thread.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from tokenizers import Encoding, Tokenizer

from gateway.features.byte_lru import ByteLRU
from gateway.features.encode_calls import encode_one
from gateway.features.novelty import PROBE_CHARS
from gateway.features.segment_encoder import EncodePlan, SegmentEncoder, TokenArray, kept_before_cut

log = logging.getLogger(__name__)

CHECKPOINT_OVERHEAD = 200  # one entry beyond its ids: key, dataclass, array header, LRU node
# texts longer than this get no checkpoints: recording reads the encoding's ids, offsets and words
# as Python lists, ~300 bytes a token at once (a 2 MB text: ~150 MB, which glibc keeps after);
# a head composed for a longer text is not checked against its encode either
MAX_TEXT_CHARS = 256 * 1024


@dataclass(frozen=True, slots=True)
class Checkpoint:
    cut: int  # the text's characters covered by the exact tokens through this block
    ctx_start: int  # character offset of the last kept word (the continuation's context)
    ctx_tokens: int  # tokens of that word
    delta: TokenArray  # the kept tokens after the previous block's cut
    # that cut: two texts sharing the previous block may cut it at different words (what
    # follows it decides which words are kept), so a delta only follows a checkpoint of this cut
    after: int = 0


@dataclass(frozen=True, slots=True)
class Known:
    """The exact leading tokens of a text, through ``cut`` characters, from checkpoints."""

    tokens: TokenArray
    cut: int
    ctx_start: int
    ctx_tokens: int
    blocks: int  # checkpoints used

    def span(self, chars: int) -> tuple[int, int]:
        """The characters a continuation to ``chars`` encodes: from the context word on."""
        return self.ctx_start, max(chars, self.cut)


class ResumedPiece(Protocol):
    """Called with an encode's first piece (``SegmentEncoder.encode_missing``'s ``on_first``:
    its encoding, where its own tokens are, where its characters start) and, for a resumed one
    (``resume_missing``), the checkpoints' head it resumed after."""

    def __call__(
        self, encoding: Encoding, span: tuple[int, int], shift: int, after: Known | None = None, /
    ) -> None: ...


class EncodingLike(Protocol):
    @property
    def ids(self) -> list[int]: ...
    @property
    def offsets(self) -> list[tuple[int, int]]: ...
    @property
    def word_ids(self) -> list[int | None]: ...


def _entry_bytes(_key: int, value: Checkpoint) -> int:
    return value.delta.nbytes + CHECKPOINT_OVERHEAD


class PrefixCheckpoints:
    """Checkpoints by block fingerprint, least recently used out first. Invariants: ``bytes <=
    max_bytes`` (``ByteLRU``'s, asserted on every put); once ``disabled``, empty for good."""

    def __init__(self, max_bytes: int) -> None:
        self._lru: ByteLRU[int, Checkpoint] = ByteLRU(
            max_bytes // CHECKPOINT_OVERHEAD, max_bytes, _entry_bytes
        )
        self.disabled = False  # set for good by a composed head its own full encode contradicted
        self.composed = 0  # heads composed from checkpoints
        self.refused = 0  # continuations whose context word came back changed
        self.mismatches = 0  # composed heads a full encode contradicted

    @property
    def bytes(self) -> int:
        return self._lru.bytes

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are kept: a byte bound above 0, and no head contradicted yet."""
        return bool(self._lru.max_bytes) and not self.disabled

    def learn(self, checkpoints: Sequence[tuple[int, Checkpoint]]) -> None:
        if self.enabled:
            for fp, cp in checkpoints:
                self._lru.put(fp, cp)

    def known(self, fingerprints: Sequence[int], *, peek: bool = False) -> Known | None:
        """The exact tokens through the longest run of leading ``fingerprints`` with checkpoints
        (None: none, or no whole word kept). ``peek``: no entry refreshed (``/admin/explain``)."""
        if not self.enabled:
            return None
        parts: list[TokenArray] = []
        last: Checkpoint | None = None
        for fp in fingerprints:
            cp = self._lru.peek(fp) if peek else self._lru.get(fp)
            if cp is None or cp.after != (0 if last is None else last.cut):
                break  # none, or learned from a text that cut the previous block elsewhere
            parts.append(cp.delta)
            last = cp
        if last is None or not last.ctx_tokens:
            return None
        return Known(np.concatenate(parts), last.cut, last.ctx_start, last.ctx_tokens, len(parts))

    def check(self, composed: TokenArray, full: TokenArray) -> bool:
        """Whether ``composed`` (a head from checkpoints) leads ``full`` (the whole text's tokens);
        if not, checkpoints are disabled: a tokenizer they are not exact for."""
        n = len(composed)
        if len(full) >= n and np.array_equal(full[:n], composed):
            return True
        self.mismatches += 1
        if not self.disabled:
            log.error("a head composed from prefix checkpoints differs from its full encode: disabled")
            self.disabled = True
            self._lru.clear()
        return False


def checkpoints_of(
    enc: EncodingLike,
    span: tuple[int, int],
    shift: int,
    fingerprints: Sequence[int],
    after: Known | None = None,
) -> tuple[list[tuple[int, Checkpoint]], TokenArray]:
    """The checkpoints of a text encoded whole, one per fingerprint of its blocks (those starting
    in it), and its tokens: ``enc``'s ``span`` (the others are context or the post-processor's);
    its characters start at ``shift`` in ``enc``'s offsets. ``after``: ``enc`` is a resumed
    encode (``resume``: from ``after``'s context word on, ``shift`` = -its start), so only the
    blocks after ``after``'s are recorded, and their kept tokens start after that word's.

    Per block j, ending at character e = (j + 1) x PROBE_CHARS: the kept tokens are those of the
    words before the one holding the last token that starts before e, and the one before it
    (``head_tokens``' rule), at least the previous block's (n_j = max over blocks <= j); the
    context word is the last kept token's. Word ids never decrease along a text, so each is a
    binary search, done for every block at once: this runs on the encode thread holding the GIL.
    Measured on an 11,000-character text (5,463 tokens, 43 blocks): 1.65 ms with per-token Python
    lists and bisects, 1.36 ms so, of which 0.58 ms is ``enc.offsets`` building its tuples."""
    lo, hi = span
    ids = enc.ids[lo:hi]
    own = np.asarray(ids, dtype=np.uint32)
    words = enc.word_ids[lo:hi]
    if not ids or None in words:
        return [], own
    # (start, end) pairs flattened by one C-level iterator: ~2x faster than an array of the tuples
    pairs = itertools.chain.from_iterable(enc.offsets[lo:hi])
    offsets = np.fromiter(pairs, dtype=np.int64, count=2 * len(ids)).reshape(-1, 2) - shift
    w = np.asarray(words, dtype=np.int64)
    # resumed: the context word's tokens are the first ``base``, kept already (at least them)
    skip, base = (after.blocks, after.ctx_tokens) if after is not None else (0, 0)
    fps = fingerprints[skip : -(-int(offsets[-1, 1]) // PROBE_CHARS)]
    ends = np.arange(skip + 1, skip + len(fps) + 1, dtype=np.int64) * PROBE_CHARS
    last = np.searchsorted(offsets[:, 0], ends, side="left") - 1  # the last token starting before e
    kept = np.where(last >= 0, np.searchsorted(w, w[np.maximum(last, 0)] - 1, side="left"), 0)
    ns = np.maximum.accumulate(np.maximum(kept, base))
    firsts = np.searchsorted(w, w[np.maximum(ns - 1, 0)], side="left")  # the context word's start
    out: list[tuple[int, Checkpoint]] = []
    prev, prev_cut = base, (after.cut if after is not None else 0)
    for fp, n, first in zip(fps, ns.tolist(), firsts.tolist(), strict=True):
        if n:
            # a copy: a view would keep the whole text's array alive beyond its bytes in the LRU
            delta = own[prev:n].copy()
            cp = Checkpoint(int(offsets[n - 1, 1]), int(offsets[first, 0]), n - first, delta, prev_cut)
        else:
            cp = Checkpoint(0, 0, 0, np.zeros(0, dtype=np.uint32))
        out.append((fp, cp))
        prev, prev_cut = n, cp.cut
    return out, own


def continue_head(tokenizer: Tokenizer, text: str, chars: int, known: Known) -> tuple[TokenArray, int] | None:
    """The exact leading tokens of ``text[:chars]`` (``head_tokens``' cut; ``text``: the whole
    prompt, or its first segment to encode) and the characters they cover, encoding only from
    ``known``'s context word on; None when that word does not come back as the same tokens
    ending at the same character."""
    start, end = known.span(chars)
    enc = encode_one(tokenizer, text[start:end], add_special_tokens=False)
    if not _resumes(enc, known):
        return None
    ids, words, offsets, k = enc.ids, enc.word_ids, enc.offsets, known.ctx_tokens
    n = kept_before_cut(words, k)
    covered = known.ctx_start + offsets[n - 1][1] if n > k else known.cut
    return np.concatenate([known.tokens, np.asarray(ids[k:n], dtype=np.uint32)]), covered


def resume(
    tokenizer: Tokenizer, text: str, after: str, known: Known
) -> tuple[TokenArray, Encoding, int] | None:
    """The tokens of the whole of ``text`` (a text encoded in one piece, or a segment followed by
    the added token ``after``), encoding only from ``known``'s context word on: its tokens, that
    encoding and where its own tokens end in it (``after``'s is context). None when the context
    word does not come back as the same tokens ending at the same character (encode it whole
    then). Exact for the reason ``continue_head`` is, up to the text's end instead of a cut."""
    enc = encode_one(tokenizer, text[known.ctx_start :] + after, add_special_tokens=False)
    ids, k = enc.ids, known.ctx_tokens
    hi = len(ids) - 1 if after else len(ids)
    if after and (hi < k or ids[-1] != tokenizer.token_to_id(after)):
        return None
    if not _resumes(enc, known):
        return None
    return np.concatenate([known.tokens, np.asarray(ids[k:hi], dtype=np.uint32)]), enc, hi


def _resumes(enc: EncodingLike, known: Known) -> bool:
    """Whether ``enc`` (of the text from ``known``'s context word on) starts with that word as
    the same tokens, ending at the same character, and nothing else in it."""
    ids, words, offsets = enc.ids, enc.word_ids, enc.offsets
    k = known.ctx_tokens
    edge = known.cut - known.ctx_start
    return not (
        len(ids) < k
        or words[0] is None
        or ids[:k] != known.tokens[-k:].tolist()
        or offsets[k - 1][1] != edge
        or any(w != words[0] for w in words[:k])
        or (len(ids) > k and (words[k] == words[0] or offsets[k][0] < edge))
    )


def resume_missing(
    enc: SegmentEncoder,
    plan: EncodePlan,
    known: Known,
    add_special_tokens: bool,
    on_first: ResumedPiece | None,
) -> list[TokenArray] | None:
    """``enc.encode_missing(plan)``'s result for a plan whose first text to encode begins with
    ``known``'s tokens (the head its request was routed on), that text encoded only from
    ``known``'s context word on (``resume``); None when refused (encode it whole). ``on_first``
    as ``encode_missing``'s, with ``known``. Pure: any thread."""
    out = resume(enc.tokenizer, plan.first_text(), plan.first_after(), known)
    if out is None:
        return None
    tokens, encoding, hi = out
    if on_first is not None:
        on_first(encoding, (0, hi), -known.ctx_start, known)
    return enc.encode_missing(plan, add_special_tokens=add_special_tokens, first=tokens)
