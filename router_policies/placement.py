"""Placement glue shared by the gateway and the simulator (docs/architecture.md, "Placement"):
what surrounds a policy's decision, so that the simulator runs the very router the gateway runs.

* Flight accounting and the TTFT model's feed (``Flight``, ``Dispatch``, ``TtftFeed``, ...) live
  in ``router_policies.flights``, the cached-token prediction (``chosen_prediction``,
  ``predicted_cached_tokens``, ``evicted_before_prefill``) in ``router_policies.cache_prediction``; both are part of this
  module's interface (imported here, so ``placement.X`` names every piece of the glue).
* ``ReplicaLoad`` and ``snapshot``: the immutable ``FleetSnapshot`` a policy sees, from each
  candidate's health, load, index match (and the part of it expected evicted before the
  request's prefill), index fullness and fitted TTFT model.
* ``TouchRule`` and ``speculative_touch``: the speculative index entry of a routed request, its
  lifetime (short when an agent reports the replica's blocks, the index TTL otherwise) and the
  refresh-at-most-once-a-second rule.
* ``replace_snapshot``: a replica's snapshot, the entries it drops kept as speculative ones.
* ``ExpirySweep``: expired speculative entries are dropped every ``EXPIRE_INTERVAL_S`` (the
  gateway's housekeeping loop; the simulator on virtual time).

Invariants
* Everything here is synchronous: the caller's decision, touch and flight start happen without an
  await in between.
* Times are passed in (seconds on any monotone clock), never read here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from router_policies.cache_prediction import chosen_prediction as chosen_prediction
from router_policies.cache_prediction import evicted_before_prefill as evicted_before_prefill
from router_policies.cache_prediction import predicted_cached_tokens as predicted_cached_tokens
from router_policies.cache_prediction import uncached_prompt_tokens as uncached_prompt_tokens
from router_policies.flights import Dispatch as Dispatch
from router_policies.flights import Flight as Flight
from router_policies.flights import FlightCounters as FlightCounters
from router_policies.flights import IndexAtDispatch as IndexAtDispatch
from router_policies.policy import FleetSnapshot, ReplicaState, RoomSchedule
from router_policies.prefix_index import PrefixIndex
from router_policies.ttft.params import TtftParams
from router_policies.ttft_feed import MAX_ERROR_RATIO as MAX_ERROR_RATIO
from router_policies.ttft_feed import MIN_OBSERVED_MS as MIN_OBSERVED_MS
from router_policies.ttft_feed import FitBudget as FitBudget
from router_policies.ttft_feed import TtftFeed as TtftFeed
from router_policies.ttft_feed import TtftProbe as TtftProbe
from router_policies.ttft_feed import TtftSample as TtftSample

TOUCH_REFRESH_S = 1.0  # a speculative chain's stamps are refreshed at most this often
EXPIRE_INTERVAL_S = 1.0  # period of the sweep of expired speculative entries
# Lifetime of a speculative entry on a replica whose agent reports its blocks: it only bridges
# the time until the engine's own events arrive (the gateway's proxy.speculative_ttl_s default).
SPECULATIVE_TTL_S = 10.0


# ---------------------------------------------------------------------- snapshot
class ReplicaLoad(NamedTuple):
    """A replica's load as a policy sees it: routed and unfinished (this router's flights plus
    what other routers report) and the engine's own figures. The fields of ``ReplicaState`` that
    follow ``healthy``, in their order (asserted below)."""

    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    pending_prefill_tokens: int = 0
    engine_running: int = 0
    engine_waiting: int = 0
    kv_usage: float = 0.0


assert ReplicaLoad._fields == tuple(f.name for f in dataclasses.fields(ReplicaState))[2:8]


class Candidate(NamedTuple):
    id: str
    healthy: bool
    load: ReplicaLoad
    pending_prefill_pairs: float = 0.0  # of this router's pending prefill (FlightCounters)
    in_flight_shared_tokens: int = 0  # FlightCounters.shared_tokens
    pending_age_ms: float = 0.0  # FlightCounters.pending_age_ms at the decision's time
    flight_prompts: Iterable[Sequence[int]] = ()  # FlightCounters.prompt_keys (this router's)
    # of load.in_flight_tokens, the expected outputs not decoded yet (this router's flights:
    # FlightCounters.unproduced_tokens at the decision's time; 0: every output counted as held)
    unproduced_tokens: int = 0
    # FlightCounters.room_schedule at the decision's time, asked only when the request may not
    # fit beside the flights (None: not known)
    room_schedule: Callable[[], RoomSchedule] | None = None


@dataclass(frozen=True, slots=True)
class IndexView:
    """The index's answer for one request: each replica's matched leading blocks and their
    medium-weighted score, and the index (for how full it believes each replica is); the
    request's keys and block size (for ``evicted_before_prefill``; none: nothing evicted) and
    its prompt tokens (for ``room_short``)."""

    blocks: Mapping[str, int]
    scores: Mapping[str, float]
    index: PrefixIndex
    keys: Sequence[int] = ()
    block_size: int = 0
    # the request's prompt tokens (its keys may cover only the head: the tail is encoded after
    # the decision, gateway/features/deferred.py); 0: as many as the keys
    prompt_tokens: int = 0

    def evicted(self, c: Candidate, capacity_tokens: int, pinned: int | None = None) -> int:
        """Of ``c``'s matched blocks, those expected evicted before the request's prefill;
        ``pinned``: ``self.pinned(c)`` when the caller has it already (else worked out here, if
        needed)."""
        matched = self.blocks.get(c.id, 0)
        queued = c.load.pending_prefill_tokens
        if not matched or not queued or capacity_tokens <= 0:
            return 0  # nothing allocates before the prefill, or no capacity known
        bs = self.block_size
        # the KV the flights there hold: at most their tokens with each cached block once (a
        # bound that settles the usual case without the arrays below), at least the queue ahead
        # (which counts other routers' flights too)
        bound = max(queued, c.load.in_flight_tokens - c.in_flight_shared_tokens)
        if bound + matched * bs <= capacity_tokens:
            return 0
        prompts = [p for p in c.flight_prompts if len(p)]
        in_use = max(queued, _distinct_blocks(prompts) * bs)
        if pinned is None:
            pinned = self.pinned(c)
        return evicted_before_prefill(matched, pinned, (queued, in_use, capacity_tokens), bs)

    def pinned(self, c: Candidate) -> int:
        """Of ``c``'s matched blocks, the leading ones a flight there holds: its prompt leads
        with them, computed or still to be computed by it (a speculative match) ahead of this
        request. The engine holds them once, however many requests use them."""
        matched = self.blocks.get(c.id, 0)
        if not matched:
            return 0
        return max((_shared_run(self.keys, p, matched) for p in c.flight_prompts), default=0)

    def room_short(self, c: Candidate, capacity_tokens: int) -> bool:
        """Whether the flights on ``c`` with their whole outputs (each shared block once) and
        this whole prompt may exceed ``capacity_tokens`` (kv_stall's room_q may fail): a bound,
        the prompt's tail block counted whole."""
        held = c.load.in_flight_tokens - c.in_flight_shared_tokens
        prompt = max(self.prompt_tokens, (len(self.keys) + 1) * self.block_size)
        return capacity_tokens > 0 and held + prompt > capacity_tokens

    def kv_over(self, c: Candidate, capacity_tokens: int) -> bool:
        """Whether the KV the flights on ``c`` hold now (their prompts, each shared block once,
        and the outputs decoded so far) and this whole prompt may exceed ``capacity_tokens``: a
        bound (the prompt's tail block counted whole); only then is ``pinned`` worth its work."""
        held = c.load.in_flight_tokens - c.in_flight_shared_tokens - c.unproduced_tokens
        return capacity_tokens > 0 and held + (len(self.keys) + 1) * self.block_size > capacity_tokens


def _distinct_blocks(prompts: Sequence[Sequence[int]]) -> int:
    """How many distinct block keys the prompts have: the blocks an engine holds for them (a
    block two requests share, computed once, is held once)."""
    return len(set().union(*prompts))


def _shared_run(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading block keys ``a`` and ``b`` share, at most ``limit``. Keys are chained
    (a key names its whole prefix), so equal keys at i mean equal keys before it: the run is
    found by bisection (log of its length in comparisons, not its length)."""
    lo, hi = 0, min(limit, len(a), len(b))  # invariant: a[:lo] == b[:lo]; the run is <= hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def snapshot(
    candidates: Iterable[Candidate],
    view: IndexView,
    exclude: frozenset[str] = frozenset(),
    ttft: Callable[[str], TtftParams | None] | None = None,
) -> FleetSnapshot:
    """The immutable fleet a policy decides on; ``exclude`` (replicas already tried) count as
    unhealthy; ``ttft``: each replica's TTFT model (``TtftFeed.params``), None for the policy's
    prior. A replica's KV capacity is its model's (``kv_capacity_tokens``: an engine setting its
    agent reported, not fitted); without models nothing is taken as evicted."""
    return FleetSnapshot(
        tuple(_state(c, view, exclude, ttft(c.id) if ttft is not None else None) for c in candidates)
    )


def _state(c: Candidate, view: IndexView, exclude: frozenset[str], model: TtftParams | None) -> ReplicaState:
    capacity = model.kv_capacity_tokens if model is not None else 0
    # the leading blocks a flight holds: worked out once, here when the KV could be short (the
    # TTFT model's X), else by ``evicted`` only if it needs them
    pinned = view.pinned(c) if model is not None and view.kv_over(c, capacity) else None
    return ReplicaState(
        c.id,
        c.healthy and c.id not in exclude,
        *c.load,
        matched_blocks=view.blocks.get(c.id, 0),
        evicted_blocks=view.evicted(c, capacity, pinned) if model is not None else 0,
        pinned_blocks=pinned or 0,
        match_score=view.scores.get(c.id, 0.0),
        held_blocks=view.index.held_count(c.id),
        pending_prefill_pairs=max(0.0, c.pending_prefill_pairs),
        in_flight_shared_tokens=max(0, c.in_flight_shared_tokens),
        pending_age_ms=c.pending_age_ms,
        in_flight_unproduced_tokens=max(0, c.unproduced_tokens),
        room_schedule=c.room_schedule()
        if c.room_schedule is not None and view.room_short(c, capacity)
        else None,
        ttft=model,
    )


# ---------------------------------------------------------------------- speculative entries
@dataclass(frozen=True, slots=True)
class TouchRule:
    """How long a routed request's speculative index entries live."""

    speculative_ttl_s: float = SPECULATIVE_TTL_S

    def lifetime_s(self, index: PrefixIndex, has_agent: bool) -> float:
        """With an agent the engine's own events follow within moments, so the entry only
        bridges that gap (``speculative_ttl_s``); without one it stands in for them until the
        index's ``approximate_ttl_s``."""
        ttl = index.config.approximate_ttl_s
        return min(self.speculative_ttl_s, ttl) if has_agent else ttl


def replace_snapshot(
    index: PrefixIndex, replica: str, entries: Mapping[int, str], keep: tuple[float, float]
) -> None:
    """Apply a replica's snapshot (its agent's whole inventory), keeping the precise entries it
    drops as speculative ones for ``keep`` = (now, lifetime_s). Why: an agent restarted beside
    a busy engine whose replay no longer reaches back reports less than the engine still holds
    (docs/agent.md, "Recovery without replay"); forgetting it at once sent that replica's
    prefixes elsewhere, to be computed again, and with them the requests whose cached-token
    counts heal the agent. Blocks the engine did evict draw traffic for ``lifetime_s`` at most,
    as a routed request's entries do; a later report makes a kept block precise again.

    The index keeps no parent links, so the kept entries stand in no known order among
    themselves (the one exception to the LRU's "each block before its parent"): they share one
    stamp and expire together, a touch orders those it walks, and evicting one before its child
    (over the approximate bound) leaves the child unmatched until it expires too. A bound error
    raised by the snapshot leaves the index as it was."""
    dropped = index.replace_replica(replica, entries)
    if dropped and not index.is_hybrid(replica):  # a hybrid engine's reusable blocks depend on windows
        now, lifetime_s = keep
        index.touch_approximate(replica, dropped, now, lifetime_s)


def speculative_keys(keys: Sequence[int], hybrid: bool) -> Sequence[int]:
    """The keys a routed request's speculative entries record: the whole prompt's on a full-
    attention engine (it keeps every block, and a later request hits its leading run); on a
    hybrid engine (matched by the deepest key, ``PrefixIndex.match``) only the prompt's last
    full block: its sliding-window group caches the blocks of the prompt's last window only, so
    an earlier block of the prompt is no hit for a request diverging after it (vLLM 0.32, see
    docs/e2e-vllm.md), while the last one is the hit of a request continuing the prompt. Even
    that one may not stay reusable (decoding past the window frees it), so on a hybrid replica
    the entry lives only until the agent's next report (``PrefixIndex`` drops it then)."""
    return keys[-1:] if hybrid else keys


def speculative_touch(
    index: PrefixIndex, replica: str, keys: Sequence[int], now: float, lifetime_s: float
) -> bool:
    """Record the speculative entries of a request routed to ``replica`` with ``keys``; returns
    whether the index was touched.

    A touch stamps a prompt's blocks leaf to root, so a leaf stamped less than
    ``TOUCH_REFRESH_S`` ago means the whole chain was; one held precisely means the engine's
    events arrived. Either way re-touching would only move the chain's stamps by less than
    ``TOUCH_REFRESH_S`` (a hot prefix is touched by every request: this was ~10% of the
    gateway's event loop)."""
    cap = index.config.approximate_blocks_per_replica
    if not len(keys) or not cap:
        return False
    leaf = int(keys[min(len(keys), cap) - 1])
    if index.holds_since(replica, leaf, now - TOUCH_REFRESH_S, lifetime_s):
        return False
    index.touch_approximate(replica, keys, now, lifetime_s)
    return True


class ExpirySweep:
    """Drops expired speculative entries once per ``interval_s``, on ticks ``start + k *
    interval_s`` (``start``: the first time it is advanced to). Sweeping at ``t`` drops everything
    a sweep at any earlier time would have (stamps are monotone along each replica's order), so
    running only the latest due tick leaves the index as every tick would."""

    __slots__ = ("_index", "_interval", "_next")

    def __init__(self, index: PrefixIndex, interval_s: float = EXPIRE_INTERVAL_S) -> None:
        self._index = index
        self._interval = interval_s
        self._next: float | None = None

    def advance(self, now: float) -> None:
        """Run the sweep of the latest tick at or before ``now``, if one is due."""
        if self._next is None:
            self._next = now + self._interval
            return
        if now < self._next:
            return
        tick = self._next + ((now - self._next) // self._interval) * self._interval
        self._index.expire(tick)
        self._next = tick + self._interval
