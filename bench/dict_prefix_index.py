# The pre-numba PrefixIndex (pure-Python dicts + int bitmasks), kept verbatim for the before/after
# comparison in bench/index_bench.py. Not used by kvgate. Its configuration, errors and match result
# are the real index's (router_policies/index_types.py).
"""Approximate global prefix index: block key -> the replicas that hold it (docs/architecture.md, "The index").

Two kinds of entries per replica:

* **precise** entries mirror what the replica's agent reports (BlockStored / BlockRemoved /
  snapshots). The engine decides evictions; the index only enforces ``max_blocks_per_replica``
  by refusing a mutation that would exceed it (``IndexBoundError``), leaving the index unchanged.
* **approximate** entries come from the gateway's own routing decisions. They bridge the time
  before the engine's events arrive, or stand in for replicas without an agent. They expire
  ``approximate_ttl_s`` after their last touch and obey ``approximate_blocks_per_replica``,
  evicting leaf first, least recently used first.

Invariants
* ``_holders[key]`` is the bit mask of replica slots holding ``key`` precisely or approximately;
  a key with an empty mask is absent from the dict.
* In each replica's approximate ``OrderedDict`` (oldest first) every block stands *before* its
  parent: a touch walks the path from the leaf back to the root, moving each entry to the end.
  Hence the first entry never has a child in the dict, so ``popitem(last=False)`` always evicts
  a leaf, and the least recently used one (a parent becomes evictable only when its children are
  gone). Touch times are monotone along the order, so TTL expiry also pops from the front.
* Mutations never await and never raise half-way: bounds are checked before anything changes.

Times are passed in by the caller (seconds, any monotone clock), so that the simulator can run
the index on virtual time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from router_policies.index_types import IndexBoundError, IndexConfig, MatchResult
from router_policies.prefix_index import GPU


@dataclass(slots=True)
class _Replica:
    slot: int
    bit: int
    # key -> medium, for precise entries
    precise: dict[int, str] = field(default_factory=dict)
    # key -> last touch time, oldest first, each block before its parent
    approx: OrderedDict[int, float] = field(default_factory=OrderedDict)
    non_gpu: int = 0  # precise entries whose medium is not GPU; 0 lets match() skip weighting


class PrefixIndex:
    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self._holders: dict[int, int] = {}
        self._replicas: dict[str, _Replica] = {}
        self._by_slot: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._entries = 0  # precise + approximate entries over all replicas

    # ---------------------------------------------------------------- replicas
    def add_replica(self, replica: str) -> None:
        if replica in self._replicas:
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            if self._next_slot >= self.config.max_replicas:
                raise IndexBoundError(f"index already tracks max_replicas={self.config.max_replicas}")
            slot = self._next_slot
            self._next_slot += 1
        self._replicas[replica] = _Replica(slot=slot, bit=1 << slot)
        self._by_slot[slot] = replica

    def remove_replica(self, replica: str) -> None:
        rep = self._replicas.get(replica)
        if rep is None:
            return
        self.clear_replica(replica)
        self.clear_approximate(replica)
        del self._replicas[replica]
        del self._by_slot[rep.slot]
        self._free_slots.append(rep.slot)

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def _rep(self, replica: str) -> _Replica:
        rep = self._replicas.get(replica)
        if rep is None:
            self.add_replica(replica)
            rep = self._replicas[replica]
        return rep

    # ---------------------------------------------------------------- precise
    def store(self, replica: str, keys: Sequence[int], medium: str = GPU) -> int:
        """Record that ``replica`` holds ``keys``; idempotent. Returns the number of new entries."""
        rep = self._rep(replica)
        precise = rep.precise
        new = [k for k in dict.fromkeys(keys) if k not in precise]
        if len(precise) + len(new) > self.config.max_blocks_per_replica:
            raise IndexBoundError(
                f"replica {replica!r} would hold {len(precise) + len(new)} blocks, "
                f"over max_blocks_per_replica={self.config.max_blocks_per_replica}"
            )
        added = sum(1 for k in new if k not in rep.approx)
        if self._entries + added > self.config.max_total_blocks:
            raise IndexBoundError(f"index would exceed max_total_blocks={self.config.max_total_blocks}")
        holders = self._holders
        bit = rep.bit
        approx = rep.approx
        for k in new:
            precise[k] = medium
            if k in approx:
                # a precise entry supersedes the approximate one
                del approx[k]
            else:
                holders[k] = holders.get(k, 0) | bit
        if medium != GPU:
            rep.non_gpu += len(new)
        self._entries += added
        return len(new)

    def remove(self, replica: str, keys: Iterable[int]) -> int:
        """Forget precise entries; keys not held are ignored. Returns the number removed."""
        rep = self._replicas.get(replica)
        if rep is None:
            return 0
        precise = rep.precise
        holders = self._holders
        mask = ~rep.bit
        removed = 0
        for k in keys:
            medium = precise.pop(k, None)
            if medium is None:
                continue
            removed += 1
            if medium != GPU:
                rep.non_gpu -= 1
            rest = holders[k] & mask
            if rest:
                holders[k] = rest
            else:
                del holders[k]
        self._entries -= removed
        return removed

    def clear_replica(self, replica: str) -> int:
        """Forget every precise entry of ``replica`` (its approximate ones stay)."""
        rep = self._replicas.get(replica)
        if rep is None:
            return 0
        return self.remove(replica, list(rep.precise))

    def replace_replica(self, replica: str, entries: Mapping[int, str]) -> None:
        """Atomically replace the precise inventory of ``replica`` (a snapshot): on a bound error
        nothing changes."""
        if len(entries) > self.config.max_blocks_per_replica:
            raise IndexBoundError(
                f"snapshot of {replica!r} has {len(entries)} blocks, "
                f"over max_blocks_per_replica={self.config.max_blocks_per_replica}"
            )
        rep = self._rep(replica)
        grow = sum(1 for k in entries if k not in rep.precise and k not in rep.approx) - sum(
            1 for k in rep.precise if k not in entries
        )
        if self._entries + grow > self.config.max_total_blocks:
            raise IndexBoundError(f"index would exceed max_total_blocks={self.config.max_total_blocks}")
        self.remove(replica, [k for k in rep.precise if k not in entries])
        by_medium: dict[str, list[int]] = {}
        for k, medium in entries.items():
            if rep.precise.get(k) != medium:
                if k in rep.precise:
                    self.remove(replica, (k,))
                by_medium.setdefault(medium, []).append(k)
        for medium, keys in by_medium.items():
            self.store(replica, keys, medium)

    def precise_keys(self, replica: str) -> list[int]:
        rep = self._replicas.get(replica)
        return list(rep.precise) if rep else []

    def precise_count(self, replica: str) -> int:
        rep = self._replicas.get(replica)
        return len(rep.precise) if rep else 0

    # ---------------------------------------------------------------- approximate
    def touch_approximate(self, replica: str, keys: Sequence[int], now: float) -> None:
        """Record that a request with the leading blocks ``keys`` was routed to ``replica``.

        Blocks the replica holds precisely are not duplicated. Evicts leaf-first LRU entries
        beyond ``approximate_blocks_per_replica`` and expires entries past their TTL."""
        rep = self._rep(replica)
        cap = self.config.approximate_blocks_per_replica
        self.expire(now, replica)
        if cap == 0:
            return
        if len(keys) > cap:
            # a prompt longer than the whole budget keeps its leading blocks: those are the ones
            # another request can share
            keys = keys[:cap]
        precise = rep.precise
        approx = rep.approx
        holders = self._holders
        bit = rep.bit
        added = 0
        # leaf to root, so that every block ends up before its parent (see the module invariant)
        for k in reversed(keys):
            if k in precise:
                continue
            if k in approx:
                approx.move_to_end(k)
                approx[k] = now
            else:
                approx[k] = now
                holders[k] = holders.get(k, 0) | bit
                added += 1
        self._entries += added
        over_total = self._entries - self.config.max_total_blocks
        overflow = max(len(approx) - cap, over_total, 0)
        for _ in range(min(overflow, len(approx))):
            k, _t = approx.popitem(last=False)
            self._drop_holder_bit(k, rep)

    def _drop_holder_bit(self, key: int, rep: _Replica) -> None:
        self._entries -= 1
        rest = self._holders[key] & ~rep.bit
        if rest:
            self._holders[key] = rest
        else:
            del self._holders[key]

    def expire(self, now: float, replica: str | None = None) -> int:
        """Drop approximate entries untouched for longer than the TTL."""
        deadline = now - self.config.approximate_ttl_s
        reps = [self._replicas[replica]] if replica is not None else list(self._replicas.values())
        dropped = 0
        for rep in reps:
            approx = rep.approx
            while approx:
                k, t = next(iter(approx.items()))
                if t >= deadline:
                    break
                del approx[k]
                self._drop_holder_bit(k, rep)
                dropped += 1
        return dropped

    def clear_approximate(self, replica: str) -> None:
        rep = self._replicas.get(replica)
        if rep is None:
            return
        while rep.approx:
            k, _t = rep.approx.popitem(last=False)
            self._drop_holder_bit(k, rep)

    def approximate_keys(self, replica: str) -> list[int]:
        """Approximate keys of ``replica``, eviction order first."""
        rep = self._replicas.get(replica)
        return list(rep.approx) if rep else []

    # ---------------------------------------------------------------- queries
    def match(self, keys: Sequence[int]) -> MatchResult:
        """Each replica's longest leading run of ``keys`` (replicas matching nothing are absent)."""
        blocks: dict[str, int] = {}
        n = len(keys)
        if n == 0:
            return MatchResult(blocks=blocks, scores={})
        holders = self._holders
        by_slot = self._by_slot
        alive = holders.get(keys[0], 0)
        i = 1
        while alive and i < n:
            nxt = alive & holders.get(keys[i], 0)
            if nxt != alive:
                self._record(alive & ~nxt, i, blocks, by_slot)
            alive = nxt
            i += 1
        if alive:
            self._record(alive, n, blocks, by_slot)
        scores: dict[str, float] = {}
        weights = self.config.medium_weights
        for name, run in blocks.items():
            rep = self._replicas[name]
            if rep.non_gpu == 0:
                scores[name] = float(run) * weights.get(GPU, 1.0)
            else:
                precise = rep.precise
                scores[name] = sum(weights.get(precise.get(k, GPU), 1.0) for k in keys[:run])
        return MatchResult(blocks=blocks, scores=scores)

    @staticmethod
    def _record(mask: int, run: int, out: dict[str, int], by_slot: Mapping[int, str]) -> None:
        while mask:
            low = mask & -mask
            out[by_slot[low.bit_length() - 1]] = run
            mask ^= low

    def holders_of(self, key: int) -> list[str]:
        mask = self._holders.get(key, 0)
        out: dict[str, int] = {}
        self._record(mask, 0, out, self._by_slot)
        return sorted(out)

    def __len__(self) -> int:
        """Distinct keys held by any replica."""
        return len(self._holders)

    @property
    def entries(self) -> int:
        """Precise plus approximate entries over all replicas (the bounded quantity)."""
        return self._entries

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            name: {"precise": len(rep.precise), "approximate": len(rep.approx)}
            for name, rep in self._replicas.items()
        }
