"""Flight accounting, the part of the placement glue (``router_policies.placement``,
docs/architecture.md, "Placement") that follows a routed attempt from dispatch to its first byte
and end (``router_policies.ttft_feed`` starts each flight and fits the TTFT model at its first byte).

* What the engine will report cached and the prefill it still has to do (counted as pending
  until the first byte): ``router_policies.cache_prediction``.
* ``FlightCounters`` and ``Flight``: this router's own load on a replica (requests, tokens,
  pending prefill and its attention pairs). A ``Flight`` is the only writer of its replica's
  counters.
* ``Dispatch``: a routed attempt as placement accounts for it (``TtftFeed.flight`` makes its
  ``Flight``); ``IndexAtDispatch``: what the index said of it, for the prediction audit.

Invariants
* Everything here is synchronous, and times are passed in (seconds on any monotone clock).
* A ``Flight`` releases exactly what it added; ``first_byte`` and ``end`` are idempotent, so the
  counters return to zero when every flight ended.
* ``unproduced_tokens(now)`` is within [0, output_tokens]: the expected outputs of the flights in
  progress not yet decoded (asserted).
"""

from __future__ import annotations

from collections.abc import KeysView, Sequence, ValuesView
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router_policies.cache_prediction import uncached_prompt_tokens
from router_policies.policy import ReplicaState, RequestFeatures, RoomSchedule
from router_policies.prefix_index import PrefixIndex
from router_policies.ttft.features import attention_pairs

if TYPE_CHECKING:  # the feed makes flights; a flight only calls back its probe's feed
    from router_policies.ttft_feed import TtftProbe, TtftSample


# ---------------------------------------------------------------------- flight accounting
# the weight of a stream's pace in a replica's moving average of seconds per output token: about
# the last ten streams (a pace changes with the batch the engine decodes, so recent ones count)
PACE_WEIGHT = 0.2


class FlightCounters:
    """This router's load on one replica. Written only by ``Flight``."""

    __slots__ = (
        "_cached_refs",
        "_decoding",
        "_decoding_output",
        "_decoding_since",
        "_flights",
        "_pending_starts",
        "_prompts",
        "output_tokens",
        "pending_prefill_pairs",
        "pending_prefill_tokens",
        "requests",
        "s_per_output_token",
        "shared_tokens",
        "started",
        "tokens",
    )

    def __init__(self) -> None:
        self.requests = 0  # routed here and not finished
        self.tokens = 0  # prompt + expected output tokens of those
        # of those tokens, cached prompt tokens counted more than once: a block predicted cached
        # for several of those requests (a prefix they share) is pinned once by the engine's paged
        # KV cache; ``tokens - shared_tokens`` is what they pin (the TTFT model's KV demand).
        # ``_cached_refs``: per block key predicted cached for one of them, how many; bounded by
        # the flights in progress and their prompts
        self.shared_tokens = 0
        self._cached_refs: dict[int, int] = {}
        self.pending_prefill_tokens = 0  # their uncached prompt tokens still awaiting a first byte
        self.pending_prefill_pairs = 0.0  # the attention pairs of that prefill (ttft.features)
        self.started = 0  # flights ever started (a statistic)
        # start time of each flight awaiting its first byte (those started with a time), keyed by
        # the flight's id: insertion order is start order (one clock, flights start as it reads),
        # so the first entry is the oldest; bounded by the flights in progress
        self._pending_starts: dict[int, float] = {}
        # each flight's prompt block keys (a reference, not a copy), keyed by the flight's id:
        # what the flights in progress hold in use or will (cache_prediction's pinned blocks)
        self._prompts: dict[int, Sequence[int]] = {}
        # the flights in progress, keyed by id (``room_schedule``); bounded by them
        self._flights: dict[int, Flight] = {}
        # Decode progress (``unproduced_tokens``): of ``tokens``, the expected output tokens; the
        # flights decoding (first byte seen at a known time), their expected outputs and the sum
        # of their first-byte times; and the replica's seconds per output token, a moving average
        # over streams read to their end (0: none yet)
        self.output_tokens = 0
        self._decoding = 0
        self._decoding_output = 0
        self._decoding_since = 0.0
        self.s_per_output_token = 0.0

    def unproduced_tokens(self, now: float) -> int:
        """Of ``output_tokens``, those not decoded yet at ``now``: the outputs of flights without a
        first byte, and of each decoding flight its output less what it has produced at the
        replica's measured pace (one token at its first byte, one per ``s_per_output_token``
        after), at most its output; without a pace yet, half. What the flights hold in the
        engine's KV now is their prompts (``tokens - shared_tokens - output_tokens``) plus
        ``output_tokens - unproduced_tokens``: outputs grow a token a step, so a replica whose
        requests will need room later may have room now (the TTFT model's KV demand)."""
        out = self._decoding_output
        if not self._decoding:
            produced = 0
        elif self.s_per_output_token > 0:
            paced = self._decoding + (self._decoding * now - self._decoding_since) / self.s_per_output_token
            produced = min(out, max(0, int(paced)))
        else:
            produced = out // 2
        left = self.output_tokens - produced
        assert 0 <= left <= self.output_tokens
        return left

    def _decoded(self, output: int, first_at: float, end: float | None) -> None:
        """A decoding flight of ``output`` expected tokens, first byte at ``first_at``, ended (at
        ``end`` when read to its end: its pace is one sample of the replica's)."""
        self._decoding -= 1
        self._decoding_output -= output
        self._decoding_since -= first_at
        if not self._decoding:
            self._decoding_since = 0.0  # no float residue once nothing decodes
        if end is not None and output > 1 and end > first_at:
            pace = (end - first_at) / (output - 1)
            prev = self.s_per_output_token
            self.s_per_output_token = pace if prev <= 0 else prev + PACE_WEIGHT * (pace - prev)

    def pending_age_ms(self, now: float) -> float:
        """How long the oldest request still awaiting its first byte here has waited (0: none)."""
        start = self.oldest_pending_start()
        return 0.0 if start is None else max(0.0, (now - start) * 1000.0)

    def oldest_pending_start(self) -> float | None:
        """When the oldest request still awaiting its first byte here started (None: none)."""
        return next(iter(self._pending_starts.values()), None)

    def prompt_keys(self) -> ValuesView[Sequence[int]]:
        """The prompt block keys of each flight in progress here (those started with keys)."""
        return self._prompts.values()

    def held_keys(self) -> KeysView[int]:
        """The block keys predicted cached for at least one flight in progress (each once)."""
        return self._cached_refs.keys()

    def room_schedule(self, now: float) -> RoomSchedule:
        """This replica's flights as its KV cache will see them free room (``RoomSchedule``;
        kv_aware's room soonest, router_policies/policies/kv_stall.py). A flight without an
        expected output (no max_tokens) has no known end: it is left out, and its KV is never
        taken as freed. A flight's end frees its prompt and output less the leading cached
        blocks another flight also holds."""
        running: list[tuple[float, int, int]] = []
        waiting: list[tuple[int, int, int]] = []
        for f in self._flights.values():  # in the order they were sent
            if f.output <= 0:
                continue
            kv = max(0, f.tokens - _run_held_twice(self._cached_refs, f.cached_keys) * f.block_size)
            if f._first_at is not None:
                running.append(((now - f._first_at) * 1000.0, f.output, kv))
            elif f._prefill_open:
                waiting.append((f.output, kv, f.prefill))
        return RoomSchedule(self.s_per_output_token * 1000.0, tuple(running), tuple(waiting))

    def _hold(self, keys: Sequence[int], block_size: int) -> None:
        refs = self._cached_refs
        for k in keys:
            n = refs.get(k, 0)
            refs[k] = n + 1
            if n:
                self.shared_tokens += block_size

    def _release(self, keys: Sequence[int], block_size: int) -> None:
        refs = self._cached_refs
        for k in keys:
            n = refs[k] - 1
            if n:
                refs[k] = n
                self.shared_tokens -= block_size
            else:
                del refs[k]


@dataclass(slots=True, eq=False)  # eq=False: a flight is itself, hashed by identity
class Flight:
    """One routed attempt on one replica; holds the load it added until released. With a
    ``TtftProbe``, its first byte (given a time) is one observation of the replica's TTFT."""

    counters: FlightCounters
    tokens: int
    prefill: int
    pairs: float = 0.0
    probe: TtftProbe | None = None
    # the block keys of its prompt predicted cached (held by the replica), and their block size
    cached_keys: Sequence[int] = ()
    block_size: int = 0
    start: float | None = None  # when it was dispatched (counts in ``pending_age_ms`` until its first byte)
    at_dispatch: IndexAtDispatch | None = None  # for the prediction audit (gateway)
    prompt_keys: Sequence[int] = ()  # its prompt's block keys (FlightCounters.prompt_keys)
    output: int = 0  # of ``tokens``, the output tokens expected (FlightCounters.unproduced_tokens)
    _open: bool = field(default=True, init=False)
    _prefill_open: bool = field(default=True, init=False)
    _first_at: float | None = field(default=None, init=False)  # its first byte's time, while decoding

    def __post_init__(self) -> None:
        c = self.counters
        c.requests += 1
        c.tokens += self.tokens
        c.output_tokens += self.output
        if len(self.prompt_keys):
            c._prompts[id(self)] = self.prompt_keys
        if self.cached_keys:
            c._hold(self.cached_keys, self.block_size)
        c.pending_prefill_tokens += self.prefill
        c.pending_prefill_pairs += self.pairs
        c.started += 1
        c._flights[id(self)] = self
        if self.start is not None:
            c._pending_starts[id(self)] = self.start

    def first_byte(self, now: float | None = None) -> TtftSample | None:
        """The first byte arrived (at ``now``: the TTFT observation, when the flight has a
        probe; without a time, or a second time, nothing is observed)."""
        if not self._prefill_open:
            return None
        self._release_prefill()
        probe = self.probe
        when = now if now is not None or probe is None else probe.feed.now()
        if when is not None and self.output:  # (ended: its prefill was released, returned above)
            self._first_at = when
            c = self.counters
            c._decoding += 1
            c._decoding_output += self.output
            c._decoding_since += when
        if probe is None or when is None:
            return None
        return probe.feed.observe(probe, when)

    def _release_prefill(self) -> None:
        if self._prefill_open:
            self._prefill_open = False
            c = self.counters
            c.pending_prefill_tokens -= self.prefill
            c.pending_prefill_pairs -= self.pairs
            c._pending_starts.pop(id(self), None)
            if c.pending_prefill_tokens == 0:
                c.pending_prefill_pairs = 0.0  # no float residue once nothing is pending

    def end(self, now: float | None = None) -> None:
        """The attempt ended (answered or failed): an unseen first byte is no observation. With
        ``now``, a stream read to its end: its pace since the first byte is measured (not given
        for a failed or cut stream, nor a whole body, whose first byte came with its last)."""
        self._release_prefill()
        if self._open:
            self._open = False
            if self._first_at is not None:
                self.counters._decoded(self.output, self._first_at, now)
                self._first_at = None
            self.counters.requests -= 1
            self.counters.tokens -= self.tokens
            self.counters.output_tokens -= self.output
            self.counters._prompts.pop(id(self), None)
            self.counters._flights.pop(id(self), None)
            if self.cached_keys:
                self.counters._release(self.cached_keys, self.block_size)


def _run_held_twice(refs: dict[int, int], keys: Sequence[int]) -> int:
    """How many leading ``keys`` (a flight's cached keys, all held) another flight holds too. A
    cached prefix is a chain and every flight holds a whole leading run of its chain, so the
    counts never grow along ``keys``: the run is found by bisection."""
    lo, hi = 0, len(keys)  # invariant: refs of keys[:lo] > 1; the run is <= hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if refs.get(keys[mid - 1], 0) > 1:
            lo = mid
        else:
            hi = mid - 1
    return lo


def int_keys(keys: Sequence[int]) -> Sequence[int]:
    """Block keys as Python ints (a numpy array's, without a per-element conversion)."""
    tolist = getattr(keys, "tolist", None)
    return tolist() if tolist is not None else list(keys)


# ---------------------------------------------------------------------- a routed attempt
@dataclass(frozen=True, slots=True)
class Dispatch:
    """A routed attempt as placement accounts for it: the chosen replica as the decision saw it
    (its ``ReplicaState`` in the decision's snapshot: the queue ahead of this request), the
    prompt, the cached tokens predicted there (``predicted_cached_tokens``) and the output
    tokens expected."""

    state: ReplicaState
    prompt_tokens: int
    cached_tokens: int
    block_size: int
    output_tokens: int
    keys: Sequence[int] = ()  # the request's block keys

    @staticmethod
    def of(state: ReplicaState, request: RequestFeatures, cached: int, output_tokens: int) -> Dispatch:
        return Dispatch(
            state, request.prompt_tokens, cached, request.block_size, output_tokens, request.block_keys
        )

    def load(self) -> tuple[int, int, float]:
        """What its flight adds to the replica's counters: tokens (prompt and expected output),
        the uncached prompt tokens pending prefill, and their attention pairs. ``TtftFeed.flight``
        opens the flight with these; a worker of several publishes them at the decision, before
        the flight opens (gateway/workers_shared_load.py)."""
        prefill = uncached_prompt_tokens(self.prompt_tokens, self.cached_tokens)
        pairs = attention_pairs(prefill, self.prompt_tokens - prefill)
        return self.prompt_tokens + self.output_tokens, prefill, pairs


@dataclass(frozen=True, slots=True)
class IndexAtDispatch:
    """What the index said of a dispatched request's predicted blocks, kept for the prediction
    audit's causes (``gateway.prediction_audit.inexact_cause``): how many of them led precisely
    (reported by the engine, not speculative entries), the replica's removal count then, and the
    matched blocks after them the prediction took as evicted before the prefill
    (``ReplicaState.evicted_blocks``)."""

    precise_blocks: int
    removed: int
    estimated_evicted: int = 0

    @staticmethod
    def of(index: PrefixIndex, replica: str, keys: Sequence[int], blocks: tuple[int, int]) -> IndexAtDispatch:
        """``blocks``: (predicted cached, estimated evicted)."""
        predicted, evicted = blocks
        run = index.precise_run(replica, keys[:predicted]) if predicted else 0
        return IndexAtDispatch(run, index.removed_count(replica), evicted)
