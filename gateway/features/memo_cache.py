"""Results of pure steps of the features pipeline, for prompts seen before (docs/architecture.md,
"Request path": features).

Three steps cost tens of microseconds a request and are pure functions of their inputs:
- a prompt text's tokens (segment_encoder.py: splitting, one cache lookup a segment, joining),
  of the tokenizer, the text and whether special tokens are added;
- a chat template's rendering of a conversation (``chat_template.ChatTemplate.render``; ~30 us
  for an 8 KB chat), of the conversation, tools, documents and template arguments;
- a prompt's block keys (``router_policies.block_keys``; one hash call a block, ~30 us for an
  8 KB prompt), of the key namespace (model, adapter, cache salt), the block size and the tokens.
A resent prompt (a retried request, the same document asked about again, a replayed
conversation) pays them again. ``MemoCache`` keeps their results, found by a 128-bit xxh3 digest
of the inputs' bytes (a collision is as likely as one between block keys), in one LRU bounded in
bytes (``proxy.memo_cache_bytes``; 0 disables it). A hit is exact by construction: same inputs,
same output. Event-loop thread only.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import xxhash

from gateway.features.byte_lru import ByteLRU
from gateway.features.segment_encoder import TokenArray

if TYPE_CHECKING:
    from gateway.features.prompt import Text

ENTRY_OVERHEAD = 400  # an entry's OrderedDict slot, its key tuple and the value's header
KEY_BYTES = 40  # one block key: the tuple's pointer and a 64-bit int object

KeyNamespace = tuple[str, str | None, str | None, int]  # model, adapter, cache salt, block size


def digest(raw: bytes) -> int:
    return xxhash.xxh3_128_intdigest(raw)


@dataclass(slots=True)
class TextTokens:
    """A text's entry: ``found`` (its tokens and the segments they were encoded in), or a miss
    that ``keep`` fills once the text is encoded."""

    cache: MemoCache
    key: Hashable
    found: tuple[TokenArray, int] | None

    def keep(self, tokens: TokenArray, segments: int) -> None:
        tokens = tokens.copy()
        tokens.setflags(write=False)  # shared by every request that resends the text
        self.cache.put(self.key, (tokens, segments), ENTRY_OVERHEAD + tokens.nbytes)


def _entry_size(_key: Hashable, entry: tuple[object, int]) -> int:
    return entry[1]


class MemoCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        # entries are (value, its bytes); bounded in bytes only (0: off)
        self._lru = ByteLRU[Hashable, tuple[object, int]](
            sys.maxsize if max_bytes else 0, max_bytes, _entry_size
        )
        self._frozen = False  # ``read_only``

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def bytes(self) -> int:
        return self._lru.bytes

    @property
    def hits(self) -> int:
        return self._lru.hits

    @property
    def misses(self) -> int:
        return self._lru.misses

    @contextlib.contextmanager
    def read_only(self) -> Iterator[None]:
        """Within: entries are read without counting or refreshing them, and nothing is kept
        (``/admin/explain`` changes nothing). Synchronous code only: the event loop runs no
        other request meanwhile."""
        before, self._frozen = self._frozen, True
        try:
            yield
        finally:
            self._frozen = before

    def get(self, key: Hashable) -> object | None:
        entry = self._lru.peek(key) if self._frozen else self._lru.get(key)
        return entry[0] if entry is not None else None

    def put(self, key: Hashable, value: object, size: int) -> None:
        """Keep ``value`` (``size`` bytes, overhead included) unless it exceeds the bound or the
        memo is read-only; the least recently used entries go first."""
        if not self._frozen:
            self._lru.put(key, (value, size))

    def keys(
        self,
        namespace: KeyNamespace,
        tokens: TokenArray,
        compute: Callable[[TokenArray], list[int]],
        source: Hashable | None = None,
    ) -> list[int]:
        """The block keys of ``tokens`` in ``namespace``: remembered, or ``compute(tokens)``.
        ``source``: what ``tokens`` are a pure function of, when the caller knows (a text's
        memo key and the truncation applied): the entry is then found by it, without digesting
        the tokens again (the text was digested already to find its tokens)."""
        if self.max_bytes == 0:
            return compute(tokens)
        if source is not None:
            key: Hashable = ("keys", *namespace, source)
        else:
            raw = np.ascontiguousarray(tokens, dtype=np.uint32).tobytes()
            key = ("keys", *namespace, len(raw), digest(raw))
        hit = self.get(key)
        if hit is not None:
            return list(cast(tuple[int, ...], hit))
        keys = compute(tokens)
        self.put(key, tuple(keys), ENTRY_OVERHEAD + KEY_BYTES * len(keys))
        return keys

    def text_tokens(self, tokenizer: str, prompt: Text) -> TextTokens | None:
        """The memo entry of ``prompt``'s tokens (None: the memo is off)."""
        if self.max_bytes == 0:
            return None
        raw = prompt.text.encode("utf-8", "surrogatepass")
        key = ("tokens", tokenizer, prompt.add_special_tokens, len(raw), digest(raw))
        return TextTokens(self, key, cast(tuple[TokenArray, int] | None, self.get(key)))

    def text(self, key: Hashable, compute: Callable[[], str]) -> str:
        """A rendered text: remembered under ``key``, or ``compute()``."""
        if self.max_bytes == 0:
            return compute()
        hit = self.get(key)
        if isinstance(hit, str):
            return hit
        text = compute()
        self.put(key, text, ENTRY_OVERHEAD + sys.getsizeof(text))
        return text
