"""Session turns against cache lifetime: the gap between a session's turns, and the share of
returning turns whose prefix had been evicted (docs/operators.md, "Cache lifetime").

A returning turn is a request whose session was seen before. Its *reusable prefix* is the run of
leading block keys it shares with the session's previous turn (keys are chained, so equal keys at
position i mean equal prompts up to block i). At the turn's arrival the prefix was:

* ``alive``: some replica held the prefix's deepest block, stored before the arrival;
* ``evicted``: no replica held it then (the engine events removed it after the previous turn;
  a block stored after the arrival was recomputed by this very turn);
* ``unknown``: no store record to judge by: the tracker's bound has dropped records (size
  ``operator.lifetime.max_tracked_blocks`` to the fleet's cache blocks), or a replica of the fleet
  sends its events to another gateway instance (shared state) or has no agent.

The engine's own view of the same turns: ``engine_missed`` counts returning turns whose
engine-reported cached tokens fall short of the reusable prefix. On a fleet whose router sends a
session to the replica holding its prefix, the two shares agree; the report shows both.

Bounds: the previous turn's keys (8 bytes per block, at most ``MAX_KEYS_PER_SESSION``) are kept
per session up to ``max_bytes`` over all sessions, the least recently seen dropped first. Single writer: ``OperatorView.answered`` on the event loop.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gateway.cache_lifetime import CacheLifetime
from gateway.log_histogram import LogHistogram
from gateway.request_outcome import Outcome

MAX_KEYS_PER_SESSION = 8192  # a longer prompt's prefix is judged on its first blocks
SESSION_OVERHEAD_BYTES = 200  # the entry, its id and the array header, roughly


@dataclass(slots=True)
class TurnCounts:
    returning: int = 0
    alive: int = 0
    evicted: int = 0
    unknown: int = 0
    no_prefix: int = 0  # shared no full block with the previous turn
    engine_missed: int = 0  # engine cached tokens < the reusable prefix
    engine_judged: int = 0  # returning turns with a prefix whose engine answer carried usage

    def as_dict(self) -> dict[str, Any]:
        judged = self.alive + self.evicted
        return {
            "returning_turns": self.returning,
            "prefix_alive": self.alive,
            "prefix_evicted": self.evicted,
            "unknown": self.unknown,
            "no_shared_prefix": self.no_prefix,
            "eviction_miss_share": self.evicted / judged if judged else None,
            "engine_missed": self.engine_missed,
            "engine_miss_share": self.engine_missed / self.engine_judged if self.engine_judged else None,
        }


@dataclass(slots=True)
class _Last:
    done: float  # time.monotonic() when the previous turn was answered
    keys: array[int]


def _size(last: _Last) -> int:
    return SESSION_OVERHEAD_BYTES + last.keys.itemsize * len(last.keys)


def common_prefix(a: array[int], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionTurns:
    def __init__(
        self,
        lifetime: CacheLifetime,
        max_bytes: int,
        fleet_replicas: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        self._lifetime = lifetime
        self._fleet_replicas = fleet_replicas
        self._max_bytes = max_bytes
        self._bytes = 0
        self._last: OrderedDict[str, _Last] = OrderedDict()
        self.gaps = LogHistogram()
        self.by_tenant: dict[str, TurnCounts] = {}

    def turn(self, o: Outcome, tenant: str) -> str | None:
        """Classify ``o`` (returns alive/evicted/unknown/no_prefix, None for a first turn) and
        remember it as the session's last turn."""
        if o.session_id is None or not o.block_keys:
            return None
        keys = o.block_keys[:MAX_KEYS_PER_SESSION]
        prev = self._last.pop(o.session_id, None)
        if prev is not None:
            self._bytes -= _size(prev)
        last = self._last[o.session_id] = _Last(o.done, array("Q", [k & 0xFFFFFFFFFFFFFFFF for k in keys]))
        self._bytes += _size(last)
        while self._bytes > self._max_bytes and self._last:
            self._bytes -= _size(self._last.popitem(last=False)[1])
        if prev is None:
            return None
        self.gaps.observe(max(0.0, o.arrival - prev.done))
        counts = self.by_tenant.get(tenant)
        if counts is None:
            counts = self.by_tenant[tenant] = TurnCounts()
        counts.returning += 1
        depth = common_prefix(prev.keys, tuple(k & 0xFFFFFFFFFFFFFFFF for k in keys))
        if depth == 0:
            counts.no_prefix += 1
            return "no_prefix"
        state = self._state_at(keys[depth - 1], o.arrival)
        if state == "alive":
            counts.alive += 1
        elif state == "evicted":
            counts.evicted += 1
        else:
            counts.unknown += 1
        if o.cached_tokens is not None:
            counts.engine_judged += 1
            if o.cached_tokens < depth * o.block_size:
                counts.engine_missed += 1
        return state

    def _state_at(self, key: int, arrival: float) -> str:
        any_record = False
        for rid in self._lifetime.replicas():
            held, stored = self._lifetime.store_time(rid, key)
            if held and stored is not None and stored <= arrival:
                return "alive"
            if held and stored is None:
                return "alive"  # held since a snapshot, before this turn
            any_record = any_record or held
        observed = self._lifetime.replicas()
        if not observed or self._lifetime.dropped:
            return "unknown"  # a dropped store record may be the very block
        if set(self._fleet_replicas()) - set(observed):
            return "unknown"  # a replica whose events this gateway does not see may hold it
        return "evicted"

    def report(self) -> dict[str, Any]:
        total = TurnCounts()
        for c in self.by_tenant.values():
            for f in TurnCounts.__slots__:
                setattr(total, f, getattr(total, f) + getattr(c, f))
        return {
            "turn_gap": {**self.gaps.summary(), "buckets": self.gaps.buckets()},
            "sessions_tracked": len(self._last),
            "session_bytes": self._bytes,
            "all": total.as_dict(),
            "by_tenant": {t: c.as_dict() for t, c in sorted(self.by_tenant.items())},
        }
