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

Time is the feed's own: the latest first byte observed (the gateway's monotonic clock, the
simulator's virtual time), so a fleet with no traffic at all makes no fit stale.
"""

from __future__ import annotations

import math
from collections.abc import KeysView

STALE_S = 10.0  # seconds without a first token while peers have theirs
MAX_REPLICAS = 4096  # as TtftModel's max_replicas: the least recently observed dropped beyond


class Freshness:
    """The time of each replica's last observed first token, and the latest of all."""

    __slots__ = ("_last", "latest", "stale_s")

    def __init__(self, stale_s: float = STALE_S) -> None:
        assert stale_s > 0
        self.stale_s = stale_s
        self.latest = -math.inf
        self._last: dict[str, float] = {}

    def observed(self, replica: str, now: float) -> None:
        self._last.pop(replica, None)  # reinserted last: the dict stays in observation order
        self._last[replica] = now
        self.latest = max(self.latest, now)
        if len(self._last) > MAX_REPLICAS:
            del self._last[next(iter(self._last))]

    def stale(self, replica: str) -> bool:
        last = self._last.get(replica)
        return last is not None and self.latest - last > self.stale_s

    def replicas(self) -> KeysView[str]:
        return self._last.keys()
