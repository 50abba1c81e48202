# The pre-numba PrefixIndex, kept for the before/after comparison in bench/index_bench.py (its
# storage and algorithms as they were). Not used by kvgate.
"""The prefix index as pure-Python dicts and int bitmasks, with the semantics, entry kinds and
invariants of ``router_policies/prefix_index.py`` (docs/architecture.md, "The index"; method by
method, its docstrings), whose numba table replaced it. Replica slots and bound checks are the
real index's own (``replica_slots.py``, ``index_types.py``); tests/bench/test_index_reference.py
holds the two to the same results.

Invariant of this storage: ``_holders[key]`` is the bit mask of replica slots holding ``key``
precisely or approximately; a key with an empty mask is absent from the dict.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from router_policies.index_types import IndexConfig, MatchResult, check_replica_bound, check_total_bound
from router_policies.prefix_index import GPU
from router_policies.replica_slots import ReplicaSlots


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
        self._slots: ReplicaSlots[_Replica] = ReplicaSlots(self.config.max_replicas)
        self._replicas = self._slots.records
        self._by_slot = self._slots.by_slot
        self._entries = 0  # precise + approximate entries over all replicas

    # ---------------------------------------------------------------- replicas
    def add_replica(self, replica: str) -> None:
        self._slots.add(replica, lambda slot: _Replica(slot=slot, bit=1 << slot))

    def remove_replica(self, replica: str) -> None:
        if replica in self._replicas:
            self.clear_replica(replica)
            self.clear_approximate(replica)
            self._slots.release(replica)

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def _rep(self, replica: str) -> _Replica:
        return self._slots.record(replica)

    # ---------------------------------------------------------------- precise
    def store(self, replica: str, keys: Sequence[int], medium: str = GPU) -> int:
        rep = self._rep(replica)
        precise = rep.precise
        new = [k for k in dict.fromkeys(keys) if k not in precise]
        check_replica_bound(self.config, len(precise) + len(new), f"replica {replica!r} would hold")
        added = sum(1 for k in new if k not in rep.approx)
        check_total_bound(self.config, self._entries + added)
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
        rep = self._replicas.get(replica)
        return self.remove(replica, list(rep.precise)) if rep is not None else 0

    def replace_replica(self, replica: str, entries: Mapping[int, str]) -> None:
        check_replica_bound(self.config, len(entries), f"snapshot of {replica!r} has")
        rep = self._rep(replica)
        grow = sum(1 for k in entries if k not in rep.precise and k not in rep.approx) - sum(
            1 for k in rep.precise if k not in entries
        )
        check_total_bound(self.config, self._entries + grow)
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
        deadline = now - self.config.approximate_ttl_s
        dropped = 0
        for rep in self._slots.selected(replica):
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
        rep = self._replicas.get(replica)
        return list(rep.approx) if rep else []

    # ---------------------------------------------------------------- queries
    def match(self, keys: Sequence[int]) -> MatchResult:
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
        return len(self._holders)

    @property
    def entries(self) -> int:
        return self._entries

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            name: {"precise": len(rep.precise), "approximate": len(rep.approx)}
            for name, rep in self._replicas.items()
        }
