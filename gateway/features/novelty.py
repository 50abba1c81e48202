"""Which prompt texts the gateway has seen before, to decide whether new text is worth encoding
before routing.

A replica can only hold KV blocks of text some request sent it. If the text that follows a
prompt's cached segments has never reached this gateway after that same prefix, no replica holds
blocks for it through us, and encoding it before routing would only give the policy keys that
match nowhere. The featurizer then routes on the cached prefix and encodes the new text in the
background. The record is a bounded set of fingerprints: ``xxh3_64`` of the prompt text up to the
first new segment plus the first ``PROBE_CHARS`` characters after it, seeded per tokenizer.

Forgetting (the set is bounded, oldest first) only ever makes text look new: the request is then
routed on its cached prefix, which is still a correct, if shorter, match.
"""

from __future__ import annotations

import xxhash

PROBE_CHARS = 256  # characters of the new text that identify it


class SeenTexts:
    """At most ``capacity`` fingerprints, least recently seen dropped first (0: nothing is ever
    seen, so new text is always deferred)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._seen: dict[int, None] = {}  # insertion order = recency

    def __len__(self) -> int:
        return len(self._seen)

    @staticmethod
    def fingerprint(seed: int, text: str, start: int) -> int:
        """Of ``text`` up to ``start`` plus ``PROBE_CHARS`` characters of what follows."""
        return xxhash.xxh3_64_intdigest(text[: start + PROBE_CHARS].encode("utf-8", "surrogatepass"), seed)

    def check_and_add(self, fingerprint: int) -> bool:
        """Whether ``fingerprint`` was seen before; records it either way."""
        seen = self._seen
        known = seen.pop(fingerprint, 0) is None  # popped to re-insert as the most recent
        if self.capacity:
            seen[fingerprint] = None
            if len(seen) > self.capacity:
                del seen[next(iter(seen))]
        return known
