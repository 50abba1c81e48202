"""consistent_hash: a hash ring over the replicas with virtual nodes, keyed on the request's
first ``prefix_blocks`` block keys, with bounded load (Mirrokni et al., "Consistent Hashing with
Bounded Loads").

The key is the chained block key of block ``prefix_blocks - 1`` (it already depends on every
earlier block), or of the last full block of a shorter prompt. A prompt with no full block is
keyed by its session id when it has one, else it goes to the least-loaded replica. Walking the
ring clockwise from the key, the first replica whose in-flight load stays within
``ceil(load_factor * (total + 1) / n)`` takes the request, so no replica exceeds ``load_factor``
times the mean, rounded up to a whole request (one request on an idle fleet is a load of 1).
"""

from __future__ import annotations

import bisect
import math

import xxhash
from pydantic import BaseModel, ConfigDict, Field

from router_policies.policy import Decision, FleetSnapshot, RequestFeatures, load_of, require_healthy


class ConsistentHashParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix_blocks: int = Field(2, ge=1, description="Leading blocks whose chained key picks the replica.")
    virtual_nodes: int = Field(160, ge=1, le=10_000, description="Ring points per replica.")
    load_factor: float = Field(1.25, ge=1.0, description="No replica takes more than this times the mean.")


class ConsistentHash:
    name = "consistent_hash"

    def __init__(self, params: ConsistentHashParams, seed: int = 0) -> None:
        self.params = params
        self._seed = seed
        self._ring_ids: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, ids: tuple[str, ...]) -> None:
        """Memoise the ring of ``ids``: a cache, not decision state (the ring is a function of
        ``ids``, the seed and ``virtual_nodes``), so ``choose`` stays pure."""
        if ids == self._ring_ids:
            return
        pts: list[tuple[int, str]] = []
        for rid in ids:
            for v in range(self.params.virtual_nodes):
                pts.append((xxhash.xxh3_64_intdigest(f"{rid}#{v}".encode(), seed=self._seed), rid))
        pts.sort()
        self._points = [p for p, _ in pts]
        self._owners = [o for _, o in pts]
        self._ring_ids = ids

    def choose(self, request: RequestFeatures, fleet: FleetSnapshot) -> Decision:
        healthy = require_healthy(fleet)
        keys = request.block_keys
        if keys:
            # re-mixed so that the ring stays uniform whatever the key distribution
            key = keys[min(self.params.prefix_blocks, len(keys)) - 1]
            h = xxhash.xxh3_64_intdigest(key.to_bytes(8, "little"), seed=self._seed)
        elif request.session_id:
            h = xxhash.xxh3_64_intdigest(request.session_id.encode(), seed=self._seed)
        else:
            best = min(healthy, key=load_of)
            return Decision(
                replica=best.id, reason="consistent_hash:no_key", matched_blocks=best.matched_blocks
            )
        self._ring(tuple(sorted(r.id for r in healthy)))
        by_id = {r.id: r for r in healthy}
        total = sum(load_of(r) for r in healthy)
        cap = math.ceil(self.params.load_factor * (total + 1) / len(healthy))
        n = len(self._points)
        start = bisect.bisect_left(self._points, h) % n
        seen: set[str] = set()
        for step in range(n):
            rid = self._owners[(start + step) % n]
            if rid in seen:
                continue
            seen.add(rid)
            r = by_id[rid]
            if load_of(r) < cap:
                reason = "consistent_hash" if step == 0 or len(seen) == 1 else "consistent_hash:bounded"
                return Decision(replica=rid, reason=reason, matched_blocks=r.matched_blocks)
        best = min(healthy, key=load_of)  # every replica at cap: unreachable as cap > mean
        return Decision(
            replica=best.id, reason="consistent_hash:all_full", matched_blocks=best.matched_blocks
        )

    def commit(self, _decision: Decision) -> None:
        """Nothing to advance: the ring and the load bound are functions of the snapshot."""
