"""Recovery without replay: AgentInventory's adoption of blocks it could not key (docs/agent.md,
"Recovery without replay"; docs/architecture.md, agent).

After an agent restart beside a warm engine whose replay buffer no longer reaches back (or an
unrecoverable event gap), every new block whose parent is an old block (a hot system prompt) has a
parent hash the agent never mapped: it is kept as an orphan (``orphans.OrphanStores``). The
gateway knows each request's keys K and hears the engine's ``cached_tokens`` N: the engine holds
K[:n] (n = N / block size) and the first block it stores for the request has the block of K[n-1]
as its parent. It sends that as a ``HeldPrefix`` hint (K[:n], the tokens of block n). The agent
finds the orphan event starting with those tokens, learns ``parent hash -> K[n-1]`` and adopts the
orphan subtree (children of adopted blocks too). Orphans whose parent the engine's own events key
later are adopted as well.

Invariants
* A learnt parent mapping is an ordinary mapping (``_map``): its removal is translated exactly.
* K[:n-1], whose engine hashes stay unknown, are held "hashless": each is referenced (``_refs``)
  once per learnt key (its anchor, a hashed descendant) that confirmed it, and released when its
  last anchor leaves the inventory. Engines evict leaf first, so an ancestor outlives its cached
  descendants: while an anchor is held its hashless ancestors are too (never a block the engine
  lost, under leaf-first eviction), and once the last anchor goes they are next to be evicted.
* A hint is used only when its last key is not held through a known hash (else the request's
  blocks were keyed, not orphaned) and exactly one orphan parent starts with its tokens; a hint
  that matches no orphan yet waits (at most ``MAX_PENDING_HINTS``, oldest dropped) for the orphan's event.
* Recovery is off for engines tracked per KV-cache group and when keys span several engine
  blocks (``key_block_size`` > ``block_size``): their blocks stay skipped, as before.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from proto.contract import GPU
from replica_agent.engine_events import BlockStored
from replica_agent.orphans import MapKey, OrphanStores, map_key

MAX_PENDING_HINTS = 256
DEFAULT_ORPHAN_BYTES = 32 * 1024 * 1024


class PrefixRecovery:
    """AgentInventory's recovery state and steps (attributes declared for the type checker;
    inventory.py owns the others)."""

    block_size: int | None
    key_block_size: int | None
    max_blocks: int
    sink: Any
    stats: Any
    _map: Any
    _refs: dict[int, int]
    _medium: dict[int, str]
    _groups: Any

    def _init_recovery(self, orphan_bytes: int) -> None:
        self._orphans = OrphanStores(orphan_bytes)
        self._pending: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        self._hashless: dict[int, int] = {}  # key -> anchors confirming it
        self._anchors: dict[int, list[int]] = {}  # learnt key -> the hashless keys it confirmed
        self._adopting: list[MapKey] | None = None  # _adopt's work list while it runs

    def _store(self, ev: BlockStored) -> None:
        raise NotImplementedError

    def _unref(self, k: int, medium: str) -> None:
        raise NotImplementedError

    def _overflow(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ views
    @property
    def orphans(self) -> OrphanStores:
        return self._orphans

    @property
    def hashless_keys(self) -> int:
        return len(self._hashless)

    def _recovering(self) -> bool:
        return self._groups is None and self.key_block_size in (None, self.block_size)

    def _hashed(self, k: int) -> bool:
        """``k`` is held through at least one engine hash the agent knows."""
        return self._refs.get(k, 0) > self._hashless.get(k, 0)

    # ------------------------------------------------------------------ inputs
    def _orphan(self, ev: BlockStored) -> None:
        """``ev``'s parent is unknown (it was skipped): keep it for adoption."""
        if ev.parent is None or not self._recovering():
            return
        self._orphans.add(ev, ev.parent)
        first = tuple(ev.token_ids[: ev.block_size])
        keys = self._pending.pop(first, None)
        if keys is not None and len(self._orphans.parents_starting(first)) == 1:
            self._learn(ev.parent, keys)

    def held_prefix(self, keys: list[int], next_tokens: list[int]) -> None:
        """The gateway's hint: the engine holds ``keys`` and stored a block of ``next_tokens``
        as the child of ``keys[-1]``'s block."""
        if not keys or not self._recovering() or len(next_tokens) != self.block_size:
            return
        self.stats.held_hints += 1
        if self._hashed(keys[-1]):
            return  # the request's new blocks had a known parent: no orphan of it to find
        first = tuple(next_tokens)
        parents = self._orphans.parents_starting(first)
        if len(parents) == 1:
            self._learn(parents.pop(), keys)
        elif not parents:
            self._pending[first] = list(keys)
            self._pending.move_to_end(first)
            while len(self._pending) > MAX_PENDING_HINTS:
                self._pending.popitem(last=False)

    # ------------------------------------------------------------------ steps
    def _learn(self, parent: MapKey, keys: list[int]) -> None:
        """``parent`` is the engine hash of ``keys[-1]``: map it, confirm the ancestors, adopt."""
        anchor = keys[-1]
        known = self._map.get(parent)
        if known is not None and known != anchor:
            return  # the hint contradicts what the engine's events said: keep those
        reported: list[int] = []
        if known is None:
            self._map[parent] = anchor
            if self._refs.get(anchor, 0) == 0:
                reported.append(anchor)
            self._refs[anchor] = self._refs.get(anchor, 0) + 1
            self._medium.setdefault(anchor, GPU)
        confirmed = self._anchors.setdefault(anchor, [])
        if len(self._hashless) < self.max_blocks:
            have = set(confirmed)
            for k in keys[:-1]:
                if k in have or self._hashed(k):
                    continue
                confirmed.append(k)
                self._hashless[k] = self._hashless.get(k, 0) + 1
                if self._refs.get(k, 0) == 0:
                    reported.append(k)
                    self._medium[k] = GPU
                self._refs[k] = self._refs.get(k, 0) + 1
        if not confirmed:
            del self._anchors[anchor]
        self.stats.confirmed_blocks += len(reported)
        if reported and self.sink is not None:
            self.sink.stored(reported, None, GPU)
        self._adopt([parent])
        if len(self._map) > self.max_blocks:
            # the parent's mapping is one more; the adopted orphans' stores keep the bound, but
            # one that returns early (token ids it cannot key) would leave it over
            self._overflow()

    def _keyed(self, hashes: list[Any], medium: str) -> None:
        """``_store`` keyed blocks ``hashes``: orphans below them can be keyed now."""
        gpu = medium == GPU
        mks = [map_key(h, medium, gpu) for h in hashes]
        if self._adopting is not None:
            self._adopting.extend(mks)  # inside _adopt: its loop takes them (no recursion)
        else:
            self._adopt(mks)

    def _adopt(self, parents: list[MapKey]) -> None:
        """Key the orphans below ``parents`` (now mapped), then their children, depth first."""
        work = self._adopting = list(parents)
        try:
            while work:
                for ev in self._orphans.take_children(work.pop()):
                    before = self.stats.stored_blocks
                    self._store(ev)  # its blocks come back through _keyed
                    self.stats.adopted_blocks += self.stats.stored_blocks - before
        finally:
            self._adopting = None

    def _released(self, k: int) -> None:
        """Key ``k`` left the inventory: the hashless keys it alone confirmed leave too."""
        confirmed = self._anchors.pop(k, None)
        self._hashless.pop(k, None)
        if confirmed is None:
            return
        for c in confirmed:
            left = self._hashless.get(c, 0) - 1
            if left < 0:
                continue  # it left already (and its count with it)
            if left:
                self._hashless[c] = left
            else:
                del self._hashless[c]
            if c in self._refs:
                self._unref(c, GPU)

    def _forget_recovery(self) -> None:
        self._orphans.clear()
        self._pending.clear()
        self._hashless.clear()
        self._anchors.clear()
