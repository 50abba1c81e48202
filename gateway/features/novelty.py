"""Which prompt texts the gateway has seen before, to decide how much new text is worth encoding
before routing.

A replica can only hold KV blocks of text some request sent it. Text that follows a prompt's
cached segments and never reached this gateway after that same prefix is in no replica's cache
through us: encoding it before routing would only give the policy keys that match nowhere. So the
new text is fingerprinted in blocks of ``PROBE_CHARS`` characters, chained (each fingerprint
covers the text up to the end of its block, seeded per tokenizer and by the text before the new
part), and the featurizer encodes before routing only the leading blocks seen before; the rest is
routed on an estimate and encoded in the background.

The record is bounded, and forgetting only ever makes text look new: the request is then routed on
less of its prefix, which is still a correct, if shorter, match. It is kept as two generations of
fingerprints rather than one least-recently-seen order: a ``dict`` whose oldest keys are deleted
one by one leaves the deleted slots at the front of its table, and every eviction scanned them
again (0.1-0.2 ms a request once a gateway had seen ``capacity`` fingerprints of new text, plus a
table rebuild of ~20 ms every few thousand requests; docs/performance.md, "The seen-text
record"). A generation is dropped whole when the newer one is full: nothing is scanned, only its
entries freed (~1 ms for 131,072 of them). The project's ``OrderedDict`` LRU (``ByteLRU``) was
measured for this too: exact, but 22-28 us a call and table rebuilds of 33-42 ms.
"""

from __future__ import annotations

import xxhash

PROBE_CHARS = 256  # characters per fingerprinted block of new text

_xxh3 = xxhash.xxh3_64_intdigest


class SeenTexts:
    """At most ``capacity`` fingerprints (0: nothing is ever seen, so new text is always
    routed before it is encoded), in two generations of at most ``gen = ceil(capacity / 2)``.

    Invariants (tests/unit/test_features_deferred.py): the last ``gen`` distinct fingerprints
    recorded are all remembered; ``len(self) <= capacity``; every fingerprint only in the older
    generation was last recorded before every one in the newer, so what is forgotten is the least
    recently seen."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._gen = (capacity + 1) // 2
        self._new: dict[int, None] = {}  # < gen entries between calls
        self._old: dict[int, None] = {}  # <= gen entries: the generation before ``_new``

    def __len__(self) -> int:
        """Entries held (a fingerprint recorded again since its generation ended is in both)."""
        return len(self._new) + len(self._old)

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
        new, old = self._new, self._old
        run = 0
        while run < len(fingerprints) and (fingerprints[run] in new or fingerprints[run] in old):
            run += 1
        return run

    def record(self, fingerprints: list[int]) -> None:
        """Remember ``fingerprints`` as the most recently seen: into the newer generation, which
        becomes the older one (the older one dropped) each time it reaches ``gen`` entries."""
        gen = self._gen
        if not gen:
            return
        new, i = self._new, 0
        while i < len(fingerprints):
            room = gen - len(new)  # >= 1: ``_new`` never stays at ``gen``
            new.update(dict.fromkeys(fingerprints[i : i + room]))
            i += room
            if len(new) >= gen:
                self._old, self._new = new, {}
                new = self._new
        assert len(new) < gen  # so that len(self) <= 2 * gen - 1 <= capacity
