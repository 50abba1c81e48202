"""Flight accounting and the TTFT model's feed, the part of the placement glue
(``router_policies.placement``, docs/architecture.md, "Placement") that follows a routed attempt
from dispatch to its first byte and end.

* What the engine will report cached and the prefill it still has to do (counted as pending
  until the first byte): ``router_policies.cache_prediction``.
* ``FlightCounters`` and ``Flight``: this router's own load on a replica (requests, tokens,
  pending prefill and its attention pairs). A ``Flight`` is the only writer of its replica's
  counters.
* ``Dispatch`` and ``TtftFeed``: the TTFT model's one writer. ``TtftFeed.flight`` starts the
  flight of a routed attempt and records the model's inputs at dispatch (the chosen replica's
  ``ReplicaState`` in the decision's snapshot, the predicted cached tokens); the flight's first
  byte fits the replica's model with the time observed since, and reports a ``TtftSample``
  (prediction at dispatch against observation) to the TTFT audit.

Invariants
* Everything here is synchronous, and times are passed in (seconds on any monotone clock).
* A ``Flight`` releases exactly what it added; ``first_byte`` and ``end`` are idempotent, so the
  counters return to zero when every flight ended.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, KeysView, Sequence, ValuesView
from dataclasses import dataclass, field

from router_policies.cache_prediction import uncached_prompt_tokens
from router_policies.policy import ReplicaState, RequestFeatures
from router_policies.prefix_index import PrefixIndex
from router_policies.ttft.features import REFERENCE_INPUTS, TtftInputs, attention_pairs, predict
from router_policies.ttft.freshness import Freshness
from router_policies.ttft.model import TtftModel
from router_policies.ttft.params import TtftParams
from router_policies.ttft.snapshot import inputs_for


# ---------------------------------------------------------------------- flight accounting
class FlightCounters:
    """This router's load on one replica. Written only by ``Flight``."""

    __slots__ = (
        "_cached_refs",
        "_pending_starts",
        "_prompts",
        "pending_prefill_pairs",
        "pending_prefill_tokens",
        "requests",
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
    _open: bool = field(default=True, init=False)
    _prefill_open: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        c = self.counters
        c.requests += 1
        c.tokens += self.tokens
        if len(self.prompt_keys):
            c._prompts[id(self)] = self.prompt_keys
        if self.cached_keys:
            c._hold(self.cached_keys, self.block_size)
        c.pending_prefill_tokens += self.prefill
        c.pending_prefill_pairs += self.pairs
        c.started += 1
        if self.start is not None:
            c._pending_starts[id(self)] = self.start

    def first_byte(self, now: float | None = None) -> TtftSample | None:
        """The first byte arrived (at ``now``: the TTFT observation, when the flight has a
        probe; without a time, or a second time, nothing is observed)."""
        if not self._prefill_open:
            return None
        self._release_prefill()
        probe = self.probe
        if probe is None:
            return None
        when = now if now is not None else probe.feed.now()
        return None if when is None else probe.feed.observe(probe, when)

    def _release_prefill(self) -> None:
        if self._prefill_open:
            self._prefill_open = False
            c = self.counters
            c.pending_prefill_tokens -= self.prefill
            c.pending_prefill_pairs -= self.pairs
            c._pending_starts.pop(id(self), None)
            if c.pending_prefill_tokens == 0:
                c.pending_prefill_pairs = 0.0  # no float residue once nothing is pending

    def end(self) -> None:
        """The attempt ended (answered or failed): an unseen first byte is no observation."""
        self._release_prefill()
        if self._open:
            self._open = False
            self.counters.requests -= 1
            self.counters.tokens -= self.tokens
            self.counters._prompts.pop(id(self), None)
            if self.cached_keys:
                self.counters._release(self.cached_keys, self.block_size)


def _int_keys(keys: Sequence[int]) -> Sequence[int]:
    """Block keys as Python ints (a numpy array's, without a per-element conversion)."""
    tolist = getattr(keys, "tolist", None)
    return tolist() if tolist is not None else list(keys)


# ---------------------------------------------------------------------- the TTFT model's feed
MIN_OBSERVED_MS = 1.0  # relative errors are taken against at least this many milliseconds
# a fit whose robust relative error scale exceeds this is not routed on (TtftFeed.params)
MAX_ERROR_RATIO = 0.5


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


@dataclass(frozen=True, slots=True)
class TtftSample:
    """One first token: the replica's model's prediction at dispatch against the observation."""

    replica: str
    predicted_ms: float
    observed_ms: float

    @property
    def relative_error(self) -> float:
        """(predicted - observed) / observed: > 0 when the model expected it later."""
        return (self.predicted_ms - self.observed_ms) / max(self.observed_ms, MIN_OBSERVED_MS)


@dataclass(frozen=True, slots=True)
class TtftProbe:
    """What a flight's first byte needs to fit the model: the inputs and prediction at dispatch."""

    feed: TtftFeed
    replica: str
    inputs: TtftInputs
    predicted_ms: float
    start: float


class TtftFeed:
    """The TTFT model's owner (``router_policies.ttft.model.TtftModel``) and its one writer: it
    records each attempt's inputs when its flight starts and fits the replica's model when the
    flight's first byte arrives. The gateway's ``Fleet`` and the simulator's ``SimGateway`` each
    hold one and start every flight through ``flight``, so both fit the same model the same way.

    ``clock``: the time a first byte without one is observed at (the gateway's monotonic clock;
    None in the simulator, which passes its virtual time). ``listener`` hears every sample (the
    TTFT audit). Inputs follow ``router_policies.ttft.snapshot.inputs_for``, the function the
    policy predicts with, on the replica's state in the decision's snapshot."""

    def __init__(
        self,
        model: TtftModel | None = None,
        clock: Callable[[], float] | None = None,
        listener: Callable[[TtftSample], None] | None = None,
        max_error_ratio: float = MAX_ERROR_RATIO,
    ) -> None:
        self.max_error_ratio = max_error_ratio
        self.model = model if model is not None else TtftModel()  # an empty model is falsy (len 0)
        self._clock = clock
        self.listener = listener
        self.freshness = Freshness()
        self._typical: tuple[float, TtftParams | None] | None = None  # (at latest, the model)

    def now(self) -> float | None:
        return self._clock() if self._clock is not None else None

    def params(self, replica: str) -> TtftParams:
        """The model the policy routes on: the replica's fit while its robust relative error
        stays within ``max_error_ratio`` or the prior predicts the same first tokens no better,
        else its prior (a fit that cannot follow the replica, say first tokens that wait seconds
        for KV behind long decodes, can mislead placement more than a prior of the right speed).
        The comparison matters: a prior of another speed than the replica's (the H100 default in
        front of engines 4x faster, bench/live.py's decode_heavy) was routed on for 171 of 300
        first tokens once every fit's scale crossed 0.5 (first tokens waiting seconds behind long
        decodes), and over-predicted them (median relative error +0.78): placement and the
        audit followed the worse model. The fit goes on learning either way. A stale fit, one on
        probation, or a replica not yet answered (``router_policies.ttft.freshness``) is priced
        as its fresh peers' typical one."""
        if self.freshness.as_peers(replica):
            typical = self._typical_fresh()
            if typical is not None:
                return typical
        fitted = self.model.params(replica)
        if (
            fitted.observations
            and fitted.error_ratio > self.max_error_ratio
            and self.model.prior_error(replica) < fitted.error_ratio
        ):
            return self.model.prior(replica)
        return fitted

    def set_kv_capacity(self, replica: str, tokens: int) -> None:
        """The replica's engine holds ``tokens`` of KV (its agent said so): the model's KV-demand
        term (``kv_capacity_tokens``) uses it. Its fit so far becomes its prior (a prior's
        capacity is a guess); nothing changes when the capacity is already that."""
        current = self.params(replica)
        if tokens <= 0 or current.kv_capacity_tokens == tokens:
            return
        self.model.set_prior(
            replica, dataclasses.replace(current, kv_capacity_tokens=tokens, observations=0, error_ratio=0.0)
        )

    def adopt(self, replica: str, peers: Iterable[str]) -> None:
        """A replica joins: it starts from the fitted model of its peers (the one of median
        speed among those with observations), not from the static prior, so that it neither
        looks faster nor slower than replicas of the same hardware until its own first tokens
        say otherwise (its fit then moves away from it). Without fitted peers: the prior."""
        typical = _typical([self.params(r) for r in peers if r != replica])
        if typical is not None:
            self.model.set_prior(replica, dataclasses.replace(typical, observations=0, error_ratio=0.0))

    def _typical_fresh(self) -> TtftParams | None:
        """The typical fit of the replicas whose fits are not stale, recomputed at most once a
        second of the feed's time (it is asked for every stale replica at every decision)."""
        latest = self.freshness.latest
        if self._typical is None or latest - self._typical[0] > 1.0:
            f = self.freshness
            self._typical = (latest, _typical([self.params(r) for r in f.replicas() if not f.as_peers(r)]))
        return self._typical[1]

    def flight(self, counters: FlightCounters, d: Dispatch, start: float | None = None) -> Flight:
        """The flight of a routed attempt (started at ``start``, default the clock's now)."""
        prefill = uncached_prompt_tokens(d.prompt_tokens, d.cached_tokens)
        cached = d.prompt_tokens - prefill
        probe = None
        when = start if start is not None else self.now()
        if when is not None:
            params = self.params(d.state.id)
            inputs = inputs_for(d.state, d.prompt_tokens, cached, d.block_size, params)
            probe = TtftProbe(self, d.state.id, inputs, predict(params, inputs).total_ms, when)
        tokens = d.prompt_tokens + d.output_tokens
        pairs = attention_pairs(prefill, cached)
        keys = _int_keys(d.keys[: cached // d.block_size] if d.block_size else ())
        return Flight(
            counters,
            tokens,
            prefill,
            pairs,
            probe,
            keys,
            d.block_size,
            start=when,
            prompt_keys=d.keys,
        )

    def observe(self, probe: TtftProbe, now: float) -> TtftSample | None:
        """Fit the first byte of ``probe``'s attempt at ``now``; the sample, or None when the
        model refused it (a time going backwards)."""
        observed_ms = (now - probe.start) * 1000.0
        probation = self._peers_predict_better(probe, observed_ms)
        if not self.model.observe_first_token(probe.replica, probe.inputs, observed_ms):
            return None
        self.freshness.observed(probe.replica, now, probation)
        sample = TtftSample(probe.replica, probe.predicted_ms, observed_ms)
        if self.listener is not None:
            self.listener(sample)
        return sample

    def _peers_predict_better(self, probe: TtftProbe, observed_ms: float) -> bool:
        """A stale or unseen replica's probe: did its fresh peers' typical fit predict it better than its
        own (``router_policies.ttft.freshness``: then it goes on probation)?"""
        f = self.freshness
        if not (f.stale(probe.replica) or f.unseen(probe.replica)) or observed_ms <= 0:
            return False
        typical = self._typical_fresh()
        if typical is None:
            return False
        own = predict(self.model.params(probe.replica), probe.inputs).total_ms
        peers = predict(typical, probe.inputs).total_ms
        return own > 0 and peers > 0 and abs(math.log(observed_ms / peers)) < abs(math.log(observed_ms / own))


def _typical(models: Sequence[TtftParams]) -> TtftParams | None:
    """The fitted model of median speed (the upper median of the reference TTFT) among those with
    observations; None without any."""
    fitted = sorted(
        (m for m in models if m.observations), key=lambda m: predict(m, REFERENCE_INPUTS).total_ms
    )
    return fitted[len(fitted) // 2] if fitted else None
