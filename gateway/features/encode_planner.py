"""Whether a text prompt is encoded before routing or routed first (docs/architecture.md,
"Request path": features; the tokenization cost is the largest on the request path).

New text is routed before it is encoded (``proxy.tokenize_defer_chars``): when at least that
many characters of a prompt are not in the segment cache, ``SeenTexts`` tells how much of the
text from the first uncached segment on reached this gateway before after the same prefix (in
``PROBE_CHARS``-character blocks). Text never seen is in no replica's cache through us, so the
plan is ``Defer``: key the exact cached prefix plus the exact tokens of the seen head, estimate
the rest and encode it after routing (``DeferredEncodes``). Text seen whole is encoded before
routing (``EncodeNow``), as are truncated prompts (their kept tokens depend on the count).

A request carrying the same new text as a deferred encode still waiting (a burst on one new
document) takes that encode over first (``DeferredEncodes.expedite``): the earlier request's
replica gets its entries, then this request is encoded and matched exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.features.deferred import DeferredEncodes
from gateway.features.novelty import PROBE_CHARS, SeenTexts
from gateway.features.prompt import Text
from gateway.features.segment_encoder import EncodePlan, SegmentEncoder

HEAD_MARGIN_CHARS = 64  # encoded past the last block of new text seen before (see plan())


@dataclass(frozen=True, slots=True)
class EncodeNow:
    plan: EncodePlan


@dataclass(frozen=True, slots=True)
class Defer:
    plan: EncodePlan
    start: int  # character offset of the first uncached segment
    head_chars: int  # characters from ``start`` encoded before routing (0: none)
    anchor: int  # the fingerprint a later request with the same new text finds the job by


EncodeStep = EncodeNow | Defer


class EncodePlanner:
    def __init__(self, defer_chars: int, seen_entries: int, deferred: DeferredEncodes) -> None:
        self.defer_chars = defer_chars
        self.seen = SeenTexts(seen_entries)
        self._deferred = deferred
        # a request sharing this many blocks of new text with a waiting deferred encode takes
        # it over (a burst); one sharing less (a common head) does not
        self._anchor_blocks = max(1, -(-defer_chars // PROBE_CHARS))

    async def plan(
        self, enc: SegmentEncoder, prompt: Text, truncated: bool, explain: bool = False
    ) -> EncodeStep:
        """The step for ``prompt``. ``explain``: record nothing and take no encode over."""
        plan = enc.plan(prompt.text, add_special_tokens=prompt.add_special_tokens, peek=explain)
        if not self.defer_chars or truncated or plan.missing_chars < self.defer_chars:
            return EncodeNow(plan)
        start = 0 if plan.whole is not None else plan.start_of(plan.missing[0])
        fingerprints = SeenTexts.fingerprints(enc.seed, prompt.text, start)
        seen = self.seen.seen_run(fingerprints, record=not explain)
        a = min(len(fingerprints), self._anchor_blocks) - 1
        if seen > a and self._deferred.pending(fingerprints[a]):
            if not explain:
                # a burst on the same new text: the earlier request's encode records its
                # replica's entries first, then this one is encoded and matched exactly
                await self._deferred.expedite(fingerprints[a])
                plan = enc.plan(prompt.text, add_special_tokens=prompt.add_special_tokens)
            return EncodeNow(plan)
        if seen < len(fingerprints):
            # the text stops matching what came before somewhere in the first block not seen:
            # encoding through it (and a margin for the words dropped at the cut) keys every
            # block another request can share
            head = (seen + 1) * PROBE_CHARS + HEAD_MARGIN_CHARS if seen else 0
            return Defer(plan, start, head, fingerprints[a])
        return EncodeNow(plan)  # all of it came before, so a replica may hold all of it
