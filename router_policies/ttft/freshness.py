"""Which replicas' TTFT fits are stale (docs/architecture.md, "Routing on predicted milliseconds").

A fit learns only from its replica's first tokens. A policy that prices speed (kv_aware's
``speed_ratio``, the ms rule) sends no new prompt to a replica whose fit looks slow, so a fit
made slow by a bad spell (a stall, a crash, a noisy neighbour) would never see the first tokens
that correct it (the likely cause of a fault-table failure with kv_aware's speed on: a replica
served 0 of 200 requests after its agent's restart; docs/performance.md, "Speed in the token
rule"). A replica's fit is stale when
no first token of it has been observed for ``stale_s`` seconds while its peers' were: the model
owner (``TtftFeed``) then prices it as its peers' typical fit until its next first token, a probe
at most every ``stale_s``. Its own fit is kept and goes on learning from that token (a reset
from its peers would throw away a true slowness, and under ``--workers`` a worker must not
change a prior the parent did not: gateway/workers_ttft.py's invariants).

A replica no first token of which was observed yet while its peers' were (unseen: the fleet
started together and others answered first) is priced as its peers too: its prior may be of
another speed than the fleet (the H100 default in front of faster engines), and a replica priced
slower than its fitted peers gets no prompt whose first token would correct it. Its first token
is a probe like a stale replica's.

The probe decides which fit to believe: when the peers' typical fit predicted it better than the
replica's own (the spell is over), the replica stays priced as its peers for its next
``PROBATION`` first tokens, its probation, while its own fit catches up; else (it is still slow)
its own fit prices it again at once. Why: one first token moves a fit by one sample; a replica
fitted 4x slow by a spell of 50-300 first tokens needed 10-22 normal ones for its fit to come
within 2x of its peers' (a seeded replay of TtftModel, docs/performance.md), i.e. 100-220 s of
probes 10 s apart for a replica that holds nothing (tests/unit/test_ttft_freshness.py: 14 for one
fitted 3x slow).

Time is the feed's own: the latest first byte observed (the gateway's monotonic clock, the
simulator's virtual time), so a fleet with no traffic at all makes no fit stale.
"""

from __future__ import annotations

import math
from collections.abc import KeysView

STALE_S = 10.0  # seconds without a first token while peers have theirs
PROBATION = 16  # first tokens a replica back from a spell stays priced as its peers (docstring)
MAX_REPLICAS = 4096  # as TtftModel's max_replicas: the least recently observed dropped beyond


class Freshness:
    """The time of each replica's last observed first token, the latest of all, and the first
    tokens left of each replica's probation (a key of ``_probation`` is a key of ``_last``)."""

    __slots__ = ("_last", "_probation", "latest", "stale_s")

    def __init__(self, stale_s: float = STALE_S) -> None:
        assert stale_s > 0
        self.stale_s = stale_s
        self.latest = -math.inf
        self._last: dict[str, float] = {}
        self._probation: dict[str, int] = {}

    def observed(self, replica: str, now: float, probation: bool = False) -> None:
        """A first token of ``replica`` at ``now``; ``probation``: it starts one (the caller
        found its peers' fit the better predictor of this probe)."""
        if probation:
            self._probation[replica] = PROBATION
        elif replica in self._probation:
            left = self._probation.pop(replica) - 1
            if left > 0:
                self._probation[replica] = left
        self._last.pop(replica, None)  # reinserted last: the dict stays in observation order
        self._last[replica] = now
        self.latest = max(self.latest, now)
        if len(self._last) > MAX_REPLICAS:
            self._probation.pop(next(iter(self._last)), None)
            del self._last[next(iter(self._last))]

    def stale(self, replica: str) -> bool:
        last = self._last.get(replica)
        return last is not None and self.latest - last > self.stale_s

    def unseen(self, replica: str) -> bool:
        """No first token of ``replica`` observed yet while its peers' were: the fleet started
        together and others answered first (``TtftFeed.adopt`` covers a replica that joins
        fitted peers). Its prior may be of another speed than the fleet's (the H100 default in
        front of faster engines), and a replica priced slower than its fitted peers gets no prompt
        whose first token would correct it: with kv_aware's fill term off for new content, a live
        fleet of four sent every request to the two replicas that answered first
        (docs/performance.md, "The fill term and new content")."""
        return replica not in self._last and bool(self._last)

    def as_peers(self, replica: str) -> bool:
        """Priced as its peers: stale, on probation, or unseen."""
        return replica in self._probation or self.stale(replica) or self.unseen(replica)

    def replicas(self) -> KeysView[str]:
        return self._last.keys()
