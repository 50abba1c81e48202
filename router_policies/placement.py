"""Placement glue shared by the gateway and the simulator (docs/architecture.md, "Placement"):
what surrounds a policy's decision, so that the simulator runs the very router the gateway runs.

* ``predicted_cached_tokens`` / ``uncached_prompt_tokens``: what the engine will report cached on
  the chosen replica, and the prefill it still has to do (counted as pending until the first
  byte).
* ``FlightCounters`` and ``Flight``: this router's own load on a replica (requests, tokens,
  pending prefill). A ``Flight`` is the only writer of its replica's counters.
* ``ReplicaLoad`` and ``snapshot``: the immutable ``FleetSnapshot`` a policy sees, from each
  candidate's health, load, index match and index fullness.
* ``TouchRule`` and ``speculative_touch``: the speculative index entry of a routed request, its
  lifetime (short when an agent reports the replica's blocks, the index TTL otherwise) and the
  refresh-at-most-once-a-second rule.
* ``ExpirySweep``: expired speculative entries are dropped every ``EXPIRE_INTERVAL_S`` (the
  gateway's housekeeping loop; the simulator on virtual time).

Invariants
* Everything here is synchronous: the caller's decision, touch and flight start happen without an
  await in between.
* A ``Flight`` releases exactly what it added; ``first_byte`` and ``end`` are idempotent, so the
  counters return to zero when every flight ended.
* Times are passed in (seconds on any monotone clock), never read here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from router_policies.policy import FleetSnapshot, ReplicaState
from router_policies.prefix_index import PrefixIndex

TOUCH_REFRESH_S = 1.0  # a speculative chain's stamps are refreshed at most this often
EXPIRE_INTERVAL_S = 1.0  # period of the sweep of expired speculative entries
# Lifetime of a speculative entry on a replica whose agent reports its blocks: it only bridges
# the time until the engine's own events arrive (the gateway's proxy.speculative_ttl_s default).
SPECULATIVE_TTL_S = 10.0


def predicted_cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """What the engine will report as cached for ``matched_blocks`` leading blocks.

    vLLM always computes at least the prompt's last token (its cache-hit length is capped at
    ``prompt_tokens - 1``), so a fully cached prompt whose length is a multiple of the block size
    reports one block less."""
    if prompt_tokens <= 0:
        return 0
    return min(matched_blocks, (prompt_tokens - 1) // block_size) * block_size


def uncached_prompt_tokens(prompt_tokens: int, predicted: int) -> int:
    """The prefill a request adds to its replica: its prompt minus the predicted cached tokens."""
    return max(0, prompt_tokens - predicted)


# ---------------------------------------------------------------------- flight accounting
class FlightCounters:
    """This router's load on one replica. Written only by ``Flight``."""

    __slots__ = ("pending_prefill_tokens", "requests", "started", "tokens")

    def __init__(self) -> None:
        self.requests = 0  # routed here and not finished
        self.tokens = 0  # prompt + expected output tokens of those
        self.pending_prefill_tokens = 0  # their uncached prompt tokens still awaiting a first byte
        self.started = 0  # flights ever started (a statistic)


class Flight:
    """One routed attempt on one replica; holds the load it added until released."""

    __slots__ = ("_open", "_prefill_open", "counters", "prefill", "tokens")

    def __init__(self, counters: FlightCounters, tokens: int, prefill: int) -> None:
        self.counters = counters
        self.tokens = tokens
        self.prefill = prefill
        self._open = True
        self._prefill_open = True
        counters.requests += 1
        counters.tokens += tokens
        counters.pending_prefill_tokens += prefill
        counters.started += 1

    def first_byte(self) -> None:
        if self._prefill_open:
            self._prefill_open = False
            self.counters.pending_prefill_tokens -= self.prefill

    def end(self) -> None:
        self.first_byte()
        if self._open:
            self._open = False
            self.counters.requests -= 1
            self.counters.tokens -= self.tokens


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


@dataclass(frozen=True, slots=True)
class IndexView:
    """The index's answer for one request: each replica's matched leading blocks and their
    medium-weighted score, and the index (for how full it believes each replica is)."""

    blocks: Mapping[str, int]
    scores: Mapping[str, float]
    index: PrefixIndex


def snapshot(
    candidates: Iterable[Candidate], view: IndexView, exclude: frozenset[str] = frozenset()
) -> FleetSnapshot:
    """The immutable fleet a policy decides on; ``exclude`` (replicas already tried) count as
    unhealthy."""
    return FleetSnapshot(
        tuple(
            ReplicaState(
                c.id,
                c.healthy and c.id not in exclude,
                *c.load,
                matched_blocks=view.blocks.get(c.id, 0),
                match_score=view.scores.get(c.id, 0.0),
                held_blocks=view.index.held_count(c.id),
            )
            for c in candidates
        )
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
