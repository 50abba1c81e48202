"""The TTFT model's feed, the part of the placement glue (``router_policies.placement``,
docs/architecture.md, "Placement") that records a routed attempt's inputs at dispatch and fits
the replica's model at its first byte (``router_policies.flights`` holds the flight itself).

* ``TtftFeed``: the TTFT model's one writer. ``TtftFeed.flight`` starts the flight of a routed
  attempt and records the model's inputs at dispatch (the chosen replica's ``ReplicaState`` in
  the decision's snapshot, the predicted cached tokens); the flight's first byte fits the
  replica's model with the time observed since, and reports a ``TtftSample`` (prediction at
  dispatch against observation) to the TTFT audit.
* ``FitBudget``: how many of a replica's first tokens the fit takes per second. Every first token
  is a sample for the audit; the fit takes them all below ``FITS_PER_S`` a replica (with bursts
  of up to ``FIT_BURST``), and beyond it the ones its budget had room for when they were
  dispatched.

Invariants
* Everything here is synchronous, and times are passed in (seconds on any monotone clock).
* Which first tokens are fitted is decided at dispatch, before any is observed: the fitted ones
  are a sample of the dispatches that does not depend on their TTFT.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from router_policies.flights import Dispatch, Flight, FlightCounters, int_keys
from router_policies.ttft.features import REFERENCE_INPUTS, TtftInputs, predict
from router_policies.ttft.freshness import Freshness
from router_policies.ttft.model import TtftModel
from router_policies.ttft.params import TtftParams
from router_policies.ttft.snapshot import inputs_for

MIN_OBSERVED_MS = 1.0  # relative errors are taken against at least this many milliseconds
# a fit whose robust relative error scale exceeds this gives way to its prior when the prior
# predicts the same first tokens better (TtftFeed.params)
MAX_ERROR_RATIO = 0.5


# The fit's budget. At the warm point (each replica answering ~500 first tokens a second) the
# first byte's observation, fit and audit sample, took 0.056 ms of a 0.517 ms request's CPU
# (docs/performance.md, "What the warm path's largest parts cost"), and consecutive first tokens
# say nearly the same thing (the fit forgets per observation, a memory of ~200 of them: 0.4 s at
# 500 a second, 2 s at the budget's 100). Live traffic of a few to a few dozen first tokens a
# second a replica, and its bursts, are fitted whole ("A fit budget" there).
FITS_PER_S = 100.0
FIT_BURST = 100.0


class FitBudget:
    """Per replica, a bucket of fits: ``burst`` at most, refilled at ``rate_per_s``. Bounded by
    ``max_replicas`` (the least recently dispatched to goes, and starts full again)."""

    __slots__ = ("_buckets", "_max", "burst", "rate_per_s")

    def __init__(
        self, rate_per_s: float = FITS_PER_S, burst: float = FIT_BURST, max_replicas: int = 4096
    ) -> None:
        assert rate_per_s > 0
        assert burst >= 1 and max_replicas > 0
        self.rate_per_s, self.burst, self._max = rate_per_s, burst, max_replicas
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # replica -> (level, at)

    def take(self, replica: str, now: float) -> bool:
        """Whether the first token of a flight dispatched to ``replica`` at ``now`` is fitted."""
        level, at = self._buckets.pop(replica, (self.burst, now))
        level = min(self.burst, level + max(0.0, now - at) * self.rate_per_s)
        fit = level >= 1.0
        self._buckets[replica] = (level - 1.0 if fit else level, max(now, at))
        if len(self._buckets) > self._max:
            self._buckets.popitem(last=False)
        return fit


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
    fit: bool = True  # whether its first token is fitted (``FitBudget``); it is a sample either way


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
        budget: FitBudget | None = None,
    ) -> None:
        self.max_error_ratio = max_error_ratio
        self.budget = budget if budget is not None else FitBudget()
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
        tokens, prefill, pairs = d.load()
        cached = d.prompt_tokens - prefill
        probe = None
        when = start if start is not None else self.now()
        if when is not None:
            params = self.params(d.state.id)
            inputs = inputs_for(d.state, d.prompt_tokens, cached, d.block_size, params)
            fit = self.budget.take(d.state.id, when)
            probe = TtftProbe(self, d.state.id, inputs, predict(params, inputs).total_ms, when, fit)
        keys = int_keys(d.keys[: cached // d.block_size] if d.block_size else ())
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
            output=d.output_tokens,
        )

    def observe(self, probe: TtftProbe, now: float) -> TtftSample | None:
        """Fit the first byte of ``probe``'s attempt at ``now`` (when its budget had room); the
        sample, or None when the model refused it (a time going backwards)."""
        observed_ms = (now - probe.start) * 1000.0
        probation = self._peers_predict_better(probe, observed_ms)
        if probe.fit:
            if not self.model.observe_first_token(probe.replica, probe.inputs, observed_ms):
                return None
        elif not (math.isfinite(observed_ms) and observed_ms >= 0):  # what the model refuses
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
