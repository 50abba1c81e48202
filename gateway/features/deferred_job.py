"""One request's text to encode after routing (``deferred.py:DeferredEncodes`` encodes it)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gateway.features.budgets import text_bytes
from gateway.features.prefix_checkpoints import Known
from gateway.features.segment_encoder import EncodePlan, SegmentEncoder, TokenArray


# eq=False: a job is itself, hashed by identity; repr=False: its own short ``__repr__`` (the
# generated one printed the whole text and its token arrays)
@dataclass(slots=True, eq=False, repr=False, weakref_slot=True)
class DeferredJob:
    """One request's text to encode after routing. The proxy sets ``on_keys`` (``Router.record``
    of the attempt it committed, replaced on a retry) while the job is not finished; it is called
    (on the event loop) with the prompt's block keys when encoded.

    Invariant: a finished job holds no ``on_keys`` nor ``on_prefix`` (``end``). The callbacks
    close over the job (the operator view and the prediction audit wrap it, keyed by it), so a
    finished job that kept them would be a reference cycle, freed only by the cycle collector:
    measured ~30 objects per deferred request, and full collections of 40-70 ms of stalled event
    loop under load (docs/performance.md, "Full collections"); tested with the collector off."""

    encoder: SegmentEncoder
    plan: EncodePlan
    add_special_tokens: bool
    fingerprint: int
    keys_of: Callable[[TokenArray], list[int]]
    on_keys: Callable[[list[int]], None] | None = field(default=None, init=False)
    # the attempt's entries for the prompt's leading keys, once a takeover encoded the shared head
    # (``Router.record``; the audit and the operator view wait for the whole keys, ``on_keys``)
    on_prefix: Callable[[list[int]], None] | None = field(default=None, init=False)
    head_busy: asyncio.Event | None = field(default=None, init=False)  # set while a head is encoded
    # a whole text's block fingerprints: its encode records their checkpoints (prefix_checkpoints.py)
    fingerprints: tuple[int, ...] = field(default=(), init=False)
    # the head routed on, when composed from checkpoints (``known``'s tokens and what followed
    # them): its encode resumes after ``known``, or, one job in ``CHECK_EVERY``, encodes the text
    # whole and checks the head against it
    head_check: TokenArray | None = field(default=None, init=False)
    known: Known | None = field(default=None, init=False)
    queued_at: float = field(default=0.0, init=False)  # event-loop time of ``submit``
    chars: int = field(init=False)
    bytes: int = field(init=False)
    finished: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def __post_init__(self) -> None:
        plan = self.plan
        self.chars = sum(len(k[2]) for k in plan.keys) if plan.whole is None else len(plan.whole)
        texts = [k[2] for k in plan.keys] if plan.whole is None else [plan.whole]
        self.bytes = sum(text_bytes(t) for t in texts)

    def composed_from(self, head: TokenArray, known: Known) -> None:
        """Its request was routed on ``head``, composed from the checkpoints ``known``
        (``continue_head``: ``known``'s tokens, then more): its encode resumes after them or
        checks ``head`` (deferred.py). ``known`` is kept over a view of ``head``, so the job holds
        the tokens once, and ``head`` counts in ``bytes``, the backlog's bound (set before the
        job is submitted)."""
        lead = head[: len(known.tokens)]
        assert np.array_equal(lead, known.tokens)  # ~2 us for 2,000 tokens, on the event loop
        self.head_check = head
        self.known = dataclasses.replace(known, tokens=lead)
        self.bytes += head.nbytes

    def __repr__(self) -> str:
        return f"DeferredJob(fingerprint={self.fingerprint:#x}, chars={self.chars})"

    def end(self) -> None:
        """The job is over (encoded, or dropped unencoded): its callbacks are let go and its
        waiters wake."""
        self.on_keys = self.on_prefix = None
        self.finished.set()
