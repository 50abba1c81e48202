"""Which prompt texts the gateway has seen before, to decide how much new text is worth encoding
before routing.

A replica can only hold KV blocks of text some request sent it. Text that follows a prompt's
cached segments and never reached this gateway after that same prefix is in no replica's cache
through us: encoding it before routing would only give the policy keys that match nowhere. So the
new text is fingerprinted in blocks of ``PROBE_CHARS`` characters, chained (each fingerprint
covers the text up to the end of its block, seeded per tokenizer and by the text before the new
part), and the featurizer encodes before routing only the leading blocks seen before; the rest is
routed on an estimate and encoded in the background.

The record is a bounded set of fingerprints, least recently seen dropped first. Forgetting only
ever makes text look new: the request is then routed on less of its prefix, which is still a
correct, if shorter, match.
"""

from __future__ import annotations

import itertools

import xxhash

PROBE_CHARS = 256  # characters per fingerprinted block of new text

_xxh3 = xxhash.xxh3_64_intdigest


class SeenTexts:
    """At most ``capacity`` fingerprints (0: nothing is ever seen, so new text is always
    routed before it is encoded)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._seen: dict[int, None] = {}  # insertion order = recency

    def __len__(self) -> int:
        return len(self._seen)

    @staticmethod
    def fingerprints(seed: int, text: str, start: int) -> list[int]:
        """One per ``PROBE_CHARS`` block of ``text[start:]`` (the last may be shorter), each
        covering everything before it."""
        h = _xxh3(text[:start].encode("utf-8", "surrogatepass"), seed)
        out = []
        for i in range(start, len(text), PROBE_CHARS):
            h = _xxh3(text[i : i + PROBE_CHARS].encode("utf-8", "surrogatepass"), h)
            out.append(h)
        return out

    def seen_run(self, fingerprints: list[int]) -> int:
        """How many leading ``fingerprints`` were seen before (a pure read: ``record`` is
        separate, so that a caller may plan the same text twice and ``/admin/explain`` changes
        nothing)."""
        seen = self._seen
        run = 0
        while run < len(fingerprints) and fingerprints[run] in seen:
            run += 1
        return run

    def record(self, fingerprints: list[int]) -> None:
        """Remember ``fingerprints`` as the most recently seen, forgetting the oldest beyond
        ``capacity``."""
        if not self.capacity:
            return
        seen = self._seen
        for fp in fingerprints:
            seen.pop(fp, None)  # re-inserted as the most recent
            seen[fp] = None
        excess = len(seen) - self.capacity
        if excess > 0:  # one pass over the oldest, not one iterator per key
            for fp in list(itertools.islice(seen, excess)):
                del seen[fp]
