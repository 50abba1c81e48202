"""How long a block lives in each replica's cache, from the engines' own store and remove events
(docs/operators.md, "Cache lifetime"; docs/architecture.md, "Inventory path").

An engine's prefix cache has no fixed lifetime: a block stays until eviction pressure removes it.
``CacheLifetime`` is an inventory observer (``inventory_ops(replica, ops)``): a stored key gets its
store time, a removed key's residency (remove time - store time) goes into the replica's histogram
and into its prefix-depth bucket (the block's position in the prompts that used it, learnt from
requests via ``note_depths``). Keys known only from a snapshot have no store time and add no
residency. ``store_time(replica, key)`` answers whether a block was present at a given moment
(``SessionTurns`` uses it to tell a turn whose prefix was evicted).

Bounds: at most ``max_tracked_blocks`` store times over all replicas (the oldest store of the
replica being written is dropped first, counted in ``dropped``); depths share the same bound.
Single writer: the inventory stream (event loop); times come from the injected clock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gateway.inventory_ops import Op
from gateway.inventory_sink import AgentHello
from gateway.log_histogram import LogHistogram

DEPTH_BUCKETS = ((0, 3), (4, 15), (16, 63), (64, 255), (256, 1 << 30))  # block positions, inclusive


def _bucket_label(depth: int) -> str:
    for lo, hi in DEPTH_BUCKETS:
        if lo <= depth <= hi:
            return f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+"
    return "unknown"


# every depth below the last bucket's start, labelled once: a removal is labelled per block,
# hundreds of blocks per evicted prompt, so a lookup rather than a search over the buckets
_LABELS = tuple(_bucket_label(d) for d in range(DEPTH_BUCKETS[-1][0]))
_DEEPEST = _bucket_label(DEPTH_BUCKETS[-1][0])


def depth_label(depth: int | None) -> str:
    """The depth bucket of a block position ("unknown" for None: no request noted its depth)."""
    if depth is None or depth < 0:
        return "unknown"
    return _LABELS[depth] if depth < len(_LABELS) else _DEEPEST


class CacheLifetime:
    def __init__(self, max_tracked_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._bound = max_tracked_blocks
        self._clock = clock
        # replica -> key -> store time (None: known from a snapshot), oldest store first
        self._stored: dict[str, OrderedDict[int, float | None]] = {}
        self._held = 0
        self._depths: OrderedDict[int, int] = OrderedDict()
        self.residency: dict[str, LogHistogram] = {}
        self.by_depth: dict[str, LogHistogram] = {}
        self.dropped = 0
        self.removals = 0

    # ------------------------------------------------------------------ the observer
    def inventory_hello(self, hello: AgentHello) -> None:
        self._stored.setdefault(hello.replica_id, OrderedDict())

    def inventory_snapshot(self, replica: str, entries: Mapping[int, str]) -> None:
        old = self._stored.pop(replica, OrderedDict())
        self._held -= len(old)
        # oldest store first: the snapshot's keys of unknown store time (held before they were
        # followed, or stored during a gap), then the known ones in their order (the snapshot
        # lists keys in the agent's order, which a key re-stored during a gap moved)
        fresh: OrderedDict[int, float | None] = OrderedDict((k, None) for k in entries if old.get(k) is None)
        fresh.update((k, t) for k, t in old.items() if t is not None and k in entries)
        self._stored[replica] = fresh
        self._held += len(fresh)
        self._enforce(replica)

    def inventory_ops(self, replica: str, ops: Sequence[Op]) -> None:
        now = self._clock()
        blocks = self._stored.setdefault(replica, OrderedDict())
        for op in ops:
            if op.kind == "s":
                for k in op.keys:
                    if k not in blocks:
                        blocks[k] = now
                        self._held += 1
            elif op.kind == "r":
                self._removed(replica, blocks, op.keys, now)
            else:  # cleared: every block goes at once (a reset, not eviction pressure)
                self._held -= len(blocks)
                blocks.clear()
        self._enforce(replica)

    def _removed(
        self, replica: str, blocks: OrderedDict[int, float | None], keys: Sequence[int], now: float
    ) -> None:
        """One remove event's keys, all at ``now``: each held one leaves ``blocks``; those with a
        store time add their residency to the replica's histogram and to their depth's, one
        ``observe_many`` per histogram (an evicted prompt removes hundreds of blocks at once)."""
        lived: list[float] = []
        by_label: dict[str, list[float]] = {}
        depths = self._depths
        for key in keys:
            if key not in blocks:
                continue
            stored = blocks.pop(key)
            self._held -= 1
            if stored is None:
                continue
            span = now - stored
            lived.append(span)
            by_label.setdefault(depth_label(depths.get(key)), []).append(span)
        if not lived:
            return
        self.removals += len(lived)
        hist = self.residency.get(replica)
        if hist is None:
            hist = self.residency[replica] = LogHistogram()
        hist.observe_many(lived)
        for label, spans in by_label.items():
            dh = self.by_depth.get(label)
            if dh is None:
                dh = self.by_depth[label] = LogHistogram()
            dh.observe_many(spans)

    def _enforce(self, replica: str) -> None:
        blocks = self._stored[replica]
        while self._held > self._bound:
            victim = blocks if blocks else max(self._stored.values(), key=len)
            victim.popitem(last=False)
            self._held -= 1
            self.dropped += 1
        while len(self._depths) > self._bound:
            self._depths.popitem(last=False)

    # ------------------------------------------------------------------ queries
    def note_depths(self, keys: Sequence[int]) -> None:
        """The request's block keys, in prompt order: key i is at depth i.

        A chained key's depth is a property of the key (it hashes the whole prefix), so a key
        already noted has the right depth, and so have its ancestors, noted by the same call or an
        earlier one (unless the bound dropped them since: they were noted first). Only the keys
        after the deepest known one are new: a resent prompt costs one lookup, not one a block."""
        depths = self._depths
        n = len(keys)
        i = n
        while i and keys[i - 1] not in depths:
            i -= 1
        if i < n:
            depths.update(zip(keys[i:], range(i, n), strict=True))
        while len(depths) > self._bound:
            depths.popitem(last=False)

    def store_time(self, replica: str, key: int) -> tuple[bool, float | None]:
        """(held now, its store time when known)."""
        blocks = self._stored.get(replica)
        if blocks is None or key not in blocks:
            return False, None
        return True, blocks[key]

    def replicas(self) -> list[str]:
        return sorted(self._stored)

    def report(self) -> dict[str, Any]:
        now = self._clock()
        per_replica = {}
        for rid in sorted(set(self._stored) | set(self.residency)):
            blocks = self._stored.get(rid, OrderedDict())
            oldest = next((t for t in blocks.values() if t is not None), None)
            hist = self.residency.get(rid, LogHistogram())
            per_replica[rid] = {
                "residency": hist.summary(),
                "held_blocks_tracked": len(blocks),
                "oldest_held_age_s": now - oldest if oldest is not None else None,
            }
        overall = LogHistogram()
        for hist in self.residency.values():
            overall = overall.merged(hist)
        return {
            "replicas": per_replica,
            "all": {**overall.summary(), "buckets": overall.buckets()},
            "by_depth": {k: h.summary() for k, h in sorted(self.by_depth.items())},
            "tracked_blocks": self._held,
            "max_tracked_blocks": self._bound,
            "dropped": self.dropped,
        }
