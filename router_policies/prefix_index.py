"""Approximate global prefix index: block key -> the replicas that hold it (docs/architecture.md, "The index").

Two kinds of entries per replica:

* **precise** entries mirror what the replica's agent reports (BlockStored / BlockRemoved /
  snapshots). The engine decides evictions; the index only enforces ``max_blocks_per_replica``
  by refusing a mutation that would exceed it (``IndexBoundError``), leaving the index unchanged.
* **approximate** entries come from the gateway's own routing decisions. They bridge the time
  before the engine's events arrive, or stand in for replicas without an agent. They expire
  ``approximate_ttl_s`` after their last touch and obey ``approximate_blocks_per_replica``,
  evicting leaf first, least recently used first.

Storage: one ``BlockTable`` (``block_table.py``, numba-compiled) holds, per block key, the mask
of replica slots holding it (17-40 bytes per key). Per replica, Python keeps only the precise
count, the media of non-GPU precise entries and the approximate entries' LRU order
(``approx_lru.py``). The replicas it tracks and their mask bits: ``replica_slots.py``; bounds and
errors: ``index_types.py``.

Invariants
* A replica's bit is set on ``key`` iff the replica holds ``key`` precisely or approximately; the
  two are disjoint, so a set bit with ``key`` absent from ``approx`` means a precise entry.
* ``precise_count`` equals the number of set bits minus ``len(approx)``.
* In each replica's approximate ``OrderedDict`` (oldest first) every block stands *before* its
  parent: a touch walks the path from the leaf back to the root, moving each entry to the end.
  Hence the first entry never has a child in the dict, so ``popitem(last=False)`` always evicts
  a leaf, and the least recently used one (a parent becomes evictable only when its children are
  gone). Touch times are monotone along the order, so TTL expiry also pops from the front.
  Except among a snapshot's kept entries (``placement.replace_snapshot``: no known order, one stamp).
* Mutations never await and never raise half-way: bounds are checked before anything changes.

Hybrid replicas (``set_hybrid``; docs/gateway.md, "Hybrid models") are matched by their deepest
held key within the prompt's bound (``match(keys, max_blocks)``), not a leading run: the engine's
hit is the deepest block every KV-cache group can serve. What stays reusable depends on windows
the gateway cannot see, so their approximate entries only bridge until the agent's next report
(any precise store or removal drops them all).

Times are passed in by the caller (seconds, any monotone clock), so that the simulator can run
the index on virtual time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from router_policies import approx_lru
from router_policies.block_table import BlockTable, as_keys
from router_policies.index_types import (
    IndexBoundError,
    IndexConfig,
    MatchResult,
    UnknownReplicaError,
    check_replica_bound,
    check_total_bound,
)
from router_policies.replica_slots import ReplicaSlots

__all__ = ["GPU", "IndexBoundError", "IndexConfig", "MatchResult", "PrefixIndex", "UnknownReplicaError"]

GPU = "GPU"


@dataclass(slots=True)
class _Replica:
    slot: int
    precise_count: int = 0
    # key -> medium, only for precise entries whose medium is not GPU (rare: offloaded blocks)
    non_gpu: dict[int, str] = field(default_factory=dict)
    # key -> last touch time, oldest first, each block before its parent
    approx: OrderedDict[int, float] = field(default_factory=OrderedDict)
    hybrid: bool = False  # matched by its deepest held key (see the module docstring)
    removed: int = 0  # precise entries ever removed (the prediction audit: removals since a decision)


class PrefixIndex:
    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self._table = BlockTable()
        self._slots: ReplicaSlots[_Replica] = ReplicaSlots(self.config.max_replicas)
        self._replicas = self._slots.records  # the slots' own dict (read here, written there)
        self._by_slot = self._slots.by_slot
        self._entries = 0  # precise + approximate entries over all replicas
        self._hybrid: set[int] = set()  # slots of hybrid replicas

    # ---------------------------------------------------------------- replicas
    def add_replica(self, replica: str) -> None:
        self._slots.add(replica, _Replica)

    def remove_replica(self, replica: str) -> None:
        if replica in self._replicas:
            self.clear_replica(replica)
            self.clear_approximate(replica)
            self._hybrid.discard(self._slots.release(replica).slot)

    def set_hybrid(self, replica: str, hybrid: bool) -> None:
        """Whether ``replica`` is matched by its deepest held key (a hybrid-attention engine)."""
        rep = self._rep(replica)
        rep.hybrid = hybrid
        if hybrid:
            self._hybrid.add(rep.slot)
        else:
            self._hybrid.discard(rep.slot)

    def is_hybrid(self, replica: str) -> bool:
        rep = self._replicas.get(replica)
        return rep is not None and rep.hybrid

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def _rep(self, replica: str) -> _Replica:
        return self._slots.record(replica)

    def _stamp(self, now: float, lifetime_s: float | None) -> float:
        """The stamp that makes an entry touched at ``now`` expire after ``lifetime_s`` (at most
        the TTL: a longer lifetime is the TTL)."""
        if lifetime_s is None:
            return now
        return now - max(0.0, self.config.approximate_ttl_s - lifetime_s)

    # ---------------------------------------------------------------- precise
    def store(self, replica: str, keys: Sequence[int], medium: str = GPU) -> int:
        """Record that ``replica`` holds ``keys``; idempotent. Returns the number of new entries."""
        rep = self._rep(replica)
        batch = as_keys(keys)
        if batch.size == 0:
            return 0
        approx = rep.approx
        # keys held approximately become precise without a new entry (bits already set)
        promoted = [k for k in dict.fromkeys(batch.tolist()) if k in approx] if approx else []
        newly = self._table.set(batch, rep.slot)
        added = len(newly)
        new = added + len(promoted)
        try:
            check_replica_bound(self.config, rep.precise_count + new, f"replica {replica!r} would hold")
            check_total_bound(self.config, self._entries + added)
        except IndexBoundError:
            self._table.unset_slots(newly, rep.slot)  # refused: the table as it was
            raise
        for k in promoted:
            # a precise entry supersedes the approximate one
            del approx[k]
        if medium != GPU:
            non_gpu = rep.non_gpu
            new_keys = self._table.keys[newly].tolist()
            for k in new_keys + promoted:
                non_gpu[k] = medium
        rep.precise_count += new
        self._entries += added
        if rep.hybrid and rep.approx:
            self.clear_approximate(replica)  # the engine's report supersedes the guesses
        return new

    def remove(self, replica: str, keys: Iterable[int]) -> int:
        """Forget precise entries; keys not held are ignored. Returns the number removed."""
        rep = self._replicas.get(replica)
        if rep is None:
            return 0
        if rep.hybrid and rep.approx:
            self.clear_approximate(replica)  # the engine's report supersedes the guesses
        if rep.approx:
            # an approximate entry is not the agent's to remove
            approx = rep.approx
            keys = [k for k in (keys.tolist() if isinstance(keys, np.ndarray) else keys) if k not in approx]
        batch = as_keys(keys if isinstance(keys, Sequence | np.ndarray) else list(keys))
        if batch.size == 0:
            return 0
        removed = self._table.unset(batch, rep.slot)
        if rep.non_gpu:
            non_gpu = rep.non_gpu
            for k in batch.tolist():
                non_gpu.pop(k, None)
        rep.precise_count -= removed
        rep.removed += removed
        self._entries -= removed
        return removed

    def clear_replica(self, replica: str) -> int:
        """Forget every precise entry of ``replica`` (its approximate ones stay)."""
        rep = self._replicas.get(replica)
        if rep is None:
            return 0
        return self.remove(replica, self._table.keys_of(rep.slot))

    def replace_replica(self, replica: str, entries: Mapping[int, str]) -> list[int]:
        """Atomically replace the precise inventory of ``replica`` (a snapshot): on a bound error
        nothing changes. Returns the precise keys it dropped."""
        check_replica_bound(self.config, len(entries), f"snapshot of {replica!r} has")
        rep = self._rep(replica)
        current = set(self.precise_keys(replica))
        approx = rep.approx
        gone = [k for k in current if k not in entries]
        grow = sum(1 for k in entries if k not in current and k not in approx) - len(gone)
        check_total_bound(self.config, self._entries + grow)
        self.remove(replica, gone)
        by_medium: dict[str, list[int]] = {}
        non_gpu = rep.non_gpu
        for k, medium in entries.items():
            if k not in current or non_gpu.get(k, GPU) != medium:
                if k in current:
                    self.remove(replica, (k,))
                by_medium.setdefault(medium, []).append(k)
        for medium, keys in by_medium.items():
            self.store(replica, keys, medium)
        return gone

    def precise_entries(self, replica: str) -> dict[int, str]:
        """Its precise keys with their medium (the index's own record: GPU unless noted)."""
        media = rep.non_gpu if (rep := self._replicas.get(replica)) else {}
        return {k: media.get(k, GPU) for k in self.precise_keys(replica)}

    def precise_keys(self, replica: str) -> list[int]:
        if (rep := self._replicas.get(replica)) is None:
            return []
        held = self._table.keys_of(rep.slot).tolist()
        approx = rep.approx
        return [k for k in held if k not in approx] if approx else held

    def precise_count(self, replica: str) -> int:
        rep = self._replicas.get(replica)
        return rep.precise_count if rep else 0

    def removed_count(self, replica: str) -> int:
        """Precise entries ever removed from ``replica`` (monotone while it is in the index)."""
        rep = self._replicas.get(replica)
        return rep.removed if rep else 0

    def precise_run(self, replica: str, keys: Sequence[int]) -> int:
        """How many leading ``keys`` ``replica`` holds precisely (reported by its engine)."""
        rep = self._replicas.get(replica)
        if rep is None or len(keys) == 0 or rep.precise_count == 0:
            return 0  # nothing reported (no agent, or none yet): no walk (the audit asks per request)
        batch = as_keys(keys)
        has = self._table.has(batch, rep.slot)
        run = len(has) if has.all() else int(has.argmin())
        # a set bit on a key in ``approx`` is an approximate entry, not a reported one
        return approx_lru.first_of(rep.approx, batch[:run].tolist()) if rep.approx else run

    def held_count(self, replica: str) -> int:
        """How full the index believes ``replica``'s cache is: its precise entries (what the
        engine reported) or, for a replica no agent reports for, its approximate ones. Precise
        replicas ignore approximate entries here because those track recent routing (load), not
        what the cache holds."""
        rep = self._replicas.get(replica)
        if rep is None:
            return 0
        return rep.precise_count or len(rep.approx)

    # ---------------------------------------------------------------- approximate
    def touch_approximate(
        self, replica: str, keys: Sequence[int], now: float, lifetime_s: float | None = None
    ) -> None:
        """Record that a request with the leading blocks ``keys`` was routed to ``replica``; the
        entries expire ``lifetime_s`` after ``now`` (default and at most: ``approximate_ttl_s``).

        Blocks the replica holds precisely are not duplicated. Evicts leaf-first LRU entries
        beyond ``approximate_blocks_per_replica`` and expires entries past their TTL."""
        rep = self._rep(replica)
        cap = self.config.approximate_blocks_per_replica
        self.expire(now, replica)
        if cap == 0:
            return
        now = self._stamp(now, lifetime_s)
        if rep.approx:
            approx_lru.lower_later_stamps(rep.approx, now)
        if len(keys) > cap:
            # a prompt longer than the whole budget keeps its leading blocks: those are the ones
            # another request can share
            keys = keys[:cap]
        batch = as_keys(keys)
        if batch.size == 0:
            return
        approx = rep.approx
        rev_arr = batch[::-1].copy()  # contiguous: the layout the kernels are compiled for
        fresh = approx_lru.touch(
            approx, rev_arr, self._table.has(rev_arr, rep.slot), now, not rep.precise_count
        )
        if fresh:
            self._table.set(as_keys(fresh), rep.slot)
            self._entries += len(fresh)
        over_total = self._entries - self.config.max_total_blocks
        overflow = min(max(len(approx) - cap, over_total, 0), len(approx))
        if overflow:
            self._drop_approximate(rep, [approx.popitem(last=False)[0] for _ in range(overflow)])

    def _drop_approximate(self, rep: _Replica, keys: list[int]) -> None:
        """Clear the bits of approximate entries already popped from ``rep.approx``."""
        if keys:
            self._entries -= self._table.unset(as_keys(keys), rep.slot)

    def expire(self, now: float, replica: str | None = None) -> int:
        """Drop approximate entries untouched for longer than the TTL."""
        deadline = now - self.config.approximate_ttl_s
        dropped = 0
        for rep in self._slots.selected(replica):
            gone = approx_lru.pop_expired(rep.approx, deadline)
            self._drop_approximate(rep, gone)
            dropped += len(gone)
        return dropped

    def clear_approximate(self, replica: str) -> None:
        rep = self._replicas.get(replica)
        if rep is None:
            return
        gone = list(rep.approx)
        rep.approx.clear()
        self._drop_approximate(rep, gone)

    def forget_approximate(self, replica: str, keys: Iterable[int]) -> int:
        """Drop ``replica``'s approximate entries for ``keys`` (precise ones and keys not held
        stay): the undo of a speculative touch whose request went elsewhere. Returns the count."""
        rep = self._replicas.get(replica)
        if rep is None:
            return 0
        gone = [k for k in keys if rep.approx.pop(k, None) is not None]
        self._drop_approximate(rep, gone)
        return len(gone)

    def holds_since(self, replica: str, key: int, since: float, lifetime_s: float | None = None) -> bool:
        """Whether ``replica`` holds ``key`` precisely, or as an approximate entry touched at or
        after ``since`` (by a touch with the same ``lifetime_s``)."""
        rep = self._replicas.get(replica)
        if rep is None:
            return False
        stamp = rep.approx.get(key)
        if stamp is not None:
            return stamp >= self._stamp(since, lifetime_s)
        return bool(self._table.has(as_keys([key]), rep.slot)[0])

    def approximate_keys(self, replica: str) -> list[int]:
        """Approximate keys of ``replica``, eviction order first."""
        rep = self._replicas.get(replica)
        return list(rep.approx) if rep else []

    def approximate_expiry(self, replica: str) -> list[tuple[int, float]]:
        """``(key, time it expires)`` of each approximate entry of ``replica``, eviction order
        first (times non-decreasing)."""
        rep = self._replicas.get(replica)
        ttl = self.config.approximate_ttl_s
        return [(k, t + ttl) for k, t in rep.approx.items()] if rep else []

    # ---------------------------------------------------------------- queries
    def match(self, keys: Sequence[int], max_blocks: int | None = None) -> MatchResult:
        """Each replica's longest leading run of ``keys``; for a hybrid replica, 1 + the position
        of its deepest held key among the first ``max_blocks`` (None: all; the engine never
        reuses the block of the prompt's last token). Replicas matching nothing are absent."""
        blocks: dict[str, int] = {}
        if len(keys) == 0:
            return MatchResult(blocks=blocks, scores={})
        batch = as_keys(keys)
        runs = self._table.match(batch)
        if self._hybrid:
            bound = batch if max_blocks is None else batch[: max(0, max_blocks)]
            deepest = self._table.deepest(bound, self._hybrid)
            for s in self._hybrid:
                runs[s] = deepest[s]
        slots = np.flatnonzero(runs)
        by_slot = self._by_slot
        blocks = dict(zip([by_slot[s] for s in slots.tolist()], runs[slots].tolist(), strict=True))
        weights = self.config.medium_weights
        gpu_weight = weights.get(GPU, 1.0)
        scores = {name: run * gpu_weight for name, run in blocks.items()}
        replicas = self._replicas
        for name, run in blocks.items():
            non_gpu = replicas[name].non_gpu
            if non_gpu:
                scores[name] = sum(weights.get(non_gpu.get(k, GPU), 1.0) for k in keys[:run])
        return MatchResult(blocks=blocks, scores=scores)

    def holders_of(self, key: int) -> list[str]:
        mask = self._table.mask_of(key)
        out: list[str] = []
        while mask:
            low = mask & -mask
            out.append(self._by_slot[low.bit_length() - 1])
            mask ^= low
        return sorted(out)

    def __len__(self) -> int:
        """Distinct keys held by any replica."""
        return self._table.live

    @property
    def entries(self) -> int:
        """Precise plus approximate entries over all replicas (the bounded quantity)."""
        return self._entries

    def table_bytes(self) -> int:
        """Bytes of the key table's arrays (the bulk of the index's memory)."""
        return self._table.nbytes()

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            name: {"precise": rep.precise_count, "approximate": len(rep.approx)}
            for name, rep in self._replicas.items()
        }
