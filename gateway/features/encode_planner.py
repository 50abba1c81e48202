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
document) takes that encode over first (``DeferredEncodes.expedite``, only as far as the two
share it): the earlier request's replica gets its entries, then what is still new in this
request is planned again: nothing (the same text: encoded and matched exactly), or its own new
tail after the shared head (requests sharing a long new system prompt or document), which is
deferred like any new text.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.features.deferred import DeferredEncodes
from gateway.features.novelty import PROBE_CHARS, SeenTexts
from gateway.features.prompt import Text
from gateway.features.segment_encoder import EncodePlan, SegmentEncoder

HEAD_MARGIN_CHARS = 64  # encoded past the last block of new text seen before (see plan())
# waiting deferred encodes one request takes over (each shares its first blocks of new text
# with what is new in the request then): a shared head's, then its own text's burst
MAX_TAKEOVERS = 2


@dataclass(frozen=True, slots=True)
class EncodeNow:
    plan: EncodePlan


@dataclass(frozen=True, slots=True)
class Defer:
    plan: EncodePlan
    start: int  # character offset of the first uncached segment
    head_chars: int  # characters from ``start`` encoded before routing (0: none)
    anchor: int  # the fingerprint a later request with the same new text finds the job by
    fingerprints: tuple[int, ...] = ()  # of the new text's blocks (``SeenTexts.fingerprints``)
    seen: int = 0  # how many of them were seen before


EncodeStep = EncodeNow | Defer


@dataclass(frozen=True, slots=True)
class _Burst:
    """The plan shares its first blocks of new text with the waiting deferred encode ``anchor``."""

    plan: EncodePlan
    anchor: int
    shared_chars: int  # the text's first characters the two share (whole blocks seen before)
    fingerprints: list[int]  # of the plan's new text, not yet recorded as seen (see _step)


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
        ast = prompt.add_special_tokens
        plan = enc.plan(prompt.text, add_special_tokens=ast, peek=explain)
        burst: _Burst | None = None
        for _ in range(MAX_TAKEOVERS):
            step = self._step(enc, prompt, plan, truncated, explain)
            if not isinstance(step, _Burst):
                break
            if explain:
                return EncodeNow(plan)
            burst = step
            # the earlier request's encode records its replica's entries first; then what is
            # still new in this one is planned as in any request: nothing left (a burst on the
            # same text: encoded now, matched exactly), or a new tail after a shared head (a
            # long system prompt, a document asked about twice at once), routed on the head and
            # encoded after (encoding it here held the event loop for milliseconds: the
            # unloaded tail of issue 15)
            await self._deferred.expedite(step.anchor, step.shared_chars)
            plan = enc.plan(prompt.text, add_special_tokens=ast)
        else:  # MAX_TAKEOVERS taken over: what is still new is encoded now
            step = EncodeNow(plan)
        if burst is not None:  # recorded after its text was planned again (see _step)
            self.seen.record(burst.fingerprints)
        return step

    def _step(
        self, enc: SegmentEncoder, prompt: Text, plan: EncodePlan, truncated: bool, explain: bool
    ) -> EncodeStep | _Burst:
        """``plan``'s step, or ``_Burst`` when it shares its first blocks of new text with a
        waiting deferred encode."""
        if not self.defer_chars or truncated or plan.missing_chars < self.defer_chars:
            return EncodeNow(plan)
        start = 0 if plan.whole is not None else plan.start_of(plan.missing[0])
        fingerprints = SeenTexts.fingerprints(enc.seed, prompt.text, start)
        # recorded only once the step is final: a burst plans the text again after the takeover,
        # and its own fingerprints recorded now would make it all "seen before" then, so encoded
        # whole on the request path instead of deferred after its shared head
        seen = self.seen.seen_run(fingerprints)
        a = min(len(fingerprints), self._anchor_blocks) - 1
        if seen > a and self._deferred.pending(fingerprints[a]):
            return _Burst(plan, fingerprints[a], start + seen * PROBE_CHARS, fingerprints)
        if not explain:
            self.seen.record(fingerprints)
        if seen < len(fingerprints):
            # the text stops matching what came before somewhere in the first block not seen:
            # encoding through it (and a margin for the words dropped at the cut) keys every
            # block another request can share
            head = (seen + 1) * PROBE_CHARS + HEAD_MARGIN_CHARS if seen else 0
            return Defer(plan, start, head, fingerprints[a], tuple(fingerprints), seen)
        return EncodeNow(plan)  # all of it came before, so a replica may hold all of it
