"""The agent's copy of its replica's KV inventory, in kvgate block keys (docs/architecture.md, "Block keys").

Re-keying: a stored block's key is ``chain_keys(parent_key, token_ids, block_size)``, where the
parent key is the key already mapped to the event's ``parent_block_hash``, or the root key of the
event's namespace (model, LoRA name, cache salt) for a first block. A bounded map from the engine's
block hash to our key finds parents and translates removals, so the engine's hash function and its
seed never matter.

Invariants
* ``_map`` (engine hash -> key, oldest first) never holds more than ``max_blocks`` entries; beyond
  it the oldest mapping is dropped as if the engine had evicted that block (it must have: the
  engine cannot hold more blocks than that, so a removal event was lost).
* ``_refs[k]`` is the number of mappings pointing to key ``k``; ``k`` is in ``_medium`` (the
  inventory) exactly when ``_refs[k] > 0``. Two engine hashes can share a key when the engine hashes
  something we do not key (multimodal inputs); a key leaves the inventory only when its last
  engine block does.
* A block stored in a medium other than GPU is mapped under ``(hash, medium)``, so that a CPU copy
  and a GPU copy of one block are removed independently. ``_medium[k]`` is the medium of the most
  recent copy stored.
* An engine with several KV-cache groups (vLLM hybrid-attention models), or one whose group is not
  full attention, is tracked per group by ``kv_groups.GroupTracker`` from its first such event
  on; the inventory is then the set of keys vLLM's hybrid prefix lookup can reuse.
* Every change is reported to the sink in the order it happens, so the sink's view (the gateway's
  index) equals ``snapshot()`` whenever the sink has seen every report since the last snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from proto.contract import GPU
from replica_agent.engine_events import AllBlocksCleared, BlockRemoved, BlockStored, EngineEvent, EngineHash
from replica_agent.inventory_groups import GroupedEvents
from replica_agent.inventory_stats import InventoryStats
from replica_agent.kv_groups import GroupTracker, order_stores
from replica_agent.recovery import DEFAULT_ORPHAN_BYTES, PrefixRecovery
from router_policies.block_keys import chain_keys, root_key


class InventorySink(Protocol):
    """Receives the inventory's changes (the gateway stream's outbox, or an index in benchmarks)."""

    def stored(self, keys: list[int], parent: int | None, medium: str) -> None: ...

    def removed(self, keys: list[int], medium: str) -> None: ...

    def cleared(self) -> None: ...


class AgentInventory(PrefixRecovery, GroupedEvents):
    def __init__(
        self,
        model: str,
        block_size: int | None,
        max_blocks: int,
        sink: InventorySink | None = None,
        key_block_size: int | None = None,
        max_namespaces: int = 4096,
        orphan_bytes: int = DEFAULT_ORPHAN_BYTES,
    ) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        if key_block_size is not None and key_block_size <= 0:
            raise ValueError("key_block_size must be positive")
        self.model = model
        self.block_size = block_size  # None until the engine or the first event tells
        # Keys cover key_block_size tokens (the gateway's block size, a multiple of the engine's);
        # None: the engine's block size. See _store_multi.
        self.key_block_size = key_block_size
        self.max_blocks = max_blocks
        self.sink = sink
        self.stats = InventoryStats()
        self._map: OrderedDict[EngineHash | tuple[EngineHash, str], int] = OrderedDict()
        # key_block_size > block_size: engine blocks that do not end a key block, with the chain
        # state their children continue from (the last key, the tokens since it); bounded by
        # max_blocks like _map
        self._partial: OrderedDict[EngineHash | tuple[EngineHash, str], tuple[int, tuple[int, ...]]] = (
            OrderedDict()
        )
        self._refs: dict[int, int] = {}
        self._medium: dict[int, str] = {}
        # parent of every held key (dropped with the key): what a switch to per-group tracking
        # needs to check sliding windows through blocks stored before it
        self._link: dict[int, int] = {}
        # Hybrid-attention engines (several KV-cache groups, or one that is not full attention)
        # are tracked per group by ``_groups`` (kv_groups.py), which then holds the inventory;
        # ``_group0`` is the group of the events seen before the switch.
        self._groups: GroupTracker | None = None
        self._group0: int | None = None
        # root keys of the (LoRA, cache salt) namespaces seen, at most max_namespaces (then reset)
        self._roots: dict[tuple[str | None, str | None], int] = {}
        self.max_namespaces = max_namespaces
        # Degraded: the inventory may miss blocks the engine holds (an unrecoverable event gap, or
        # the agent joined after the engine had cached blocks). Cleared once the engine has evicted
        # ``capacity`` blocks since then with no store skipped for want of a parent, or the engine's
        # cache was emptied (AllBlocksCleared, restart).
        self.degraded = False
        self.degraded_reason = ""
        self._rebuild_left = 0
        self.capacity_blocks = 0
        self._init_recovery(orphan_bytes)  # recovery.py: blocks adopted once their parent is learnt

    # ------------------------------------------------------------------ views
    @property
    def _view(self) -> dict[int, str]:
        return self._groups.reported if self._groups is not None else self._medium

    def __len__(self) -> int:
        return len(self._view)

    def snapshot(self) -> dict[int, str]:
        """A copy of the inventory: key -> medium (hybrid models: the reusable keys)."""
        return dict(self._view)

    def keys(self) -> list[int]:
        return list(self._view)

    @property
    def hybrid(self) -> bool:
        """The engine runs several KV-cache groups (or a non-full-attention one)."""
        return self._groups is not None

    # ------------------------------------------------------------------ state changes
    def clear(self) -> None:
        """The engine's cache is (to be treated as) empty."""
        self._map.clear()
        self._partial.clear()
        self._refs.clear()
        self._medium.clear()
        self._link.clear()
        if self._groups is not None:
            self._groups.clear()
        self._forget_recovery()
        self.stats.clears += 1
        if self.sink is not None:
            self.sink.cleared()

    def mark_degraded(self, reason: str) -> None:
        self.degraded = True
        self.degraded_reason = reason
        self._rebuild_left = self.capacity_blocks or self.max_blocks

    def _skip(self, blocks: int) -> None:
        """A stored block's parent is unknown: events were missed, the inventory is incomplete (and
        the rebuild count starts over)."""
        self.stats.skipped_blocks += blocks
        self.mark_degraded(self.degraded_reason if self.degraded else "a stored block's parent is unknown")

    def mark_complete(self) -> None:
        self.degraded = False
        self.degraded_reason = ""

    def apply(self, events: Iterable[EngineEvent]) -> None:
        if self._groups is not None:
            self._apply_grouped(order_stores(list(events)), self._groups)
            return
        evs = events if isinstance(events, list) else list(events)
        for i, ev in enumerate(evs):
            if type(ev) is BlockStored:
                if ev.group is not None and self._needs_groups(ev):
                    self._switch_to_groups()
                    assert self._groups is not None
                    self._apply_grouped(order_stores(evs[i:]), self._groups)
                    return
                self._store(ev)
            elif type(ev) is BlockRemoved:
                self._remove(ev)
            elif type(ev) is AllBlocksCleared:
                self.clear()
                self.mark_complete()

    def _apply_grouped(self, events: list[EngineEvent], groups: GroupTracker) -> None:
        for ev in events:
            if type(ev) is BlockStored:
                self._store_grouped(ev, groups)
            elif type(ev) is BlockRemoved:
                self._remove_grouped(ev, groups)
            elif type(ev) is AllBlocksCleared:
                self.clear()
                self.mark_complete()

    # ------------------------------------------------------------------ internals
    def _root(self, lora: str | None, salt: str | None) -> int:
        ns = (lora, salt)
        key = self._roots.get(ns)
        if key is None:
            if len(self._roots) >= self.max_namespaces:
                self._roots.clear()
            key = self._roots[ns] = root_key(self.model, lora, salt)
        return key

    @property
    def reported_block_size(self) -> int | None:
        """The block size the keys are computed at (what the agent's hello reports)."""
        return self.key_block_size or self.block_size

    def _store(self, ev: BlockStored) -> None:
        bs = self.block_size
        if bs is None:
            bs = self.block_size = ev.block_size
        elif ev.block_size != bs:
            self.stats.block_size_mismatches += 1
            return
        kbs = self.key_block_size
        if kbs is not None and kbs != bs:
            if kbs % bs:
                self.stats.block_size_mismatches += 1
                return
            self._store_multi(ev, bs, kbs // bs)
            return
        hashes = ev.block_hashes
        mapping = self._map
        if ev.parent is None:
            parent_key = self._root(ev.lora_name, ev.cache_salt)
        else:
            found = mapping.get(ev.parent)
            if found is None and ev.medium != GPU:
                found = mapping.get((ev.parent, ev.medium))
            if found is None:
                self._skip(len(hashes))
                self._orphan(ev)
                return
            parent_key = found
        tokens = ev.token_ids
        n = min(len(hashes), len(tokens) // bs)
        if n == 0:
            return
        if len(tokens) != n * bs:
            tokens = tokens[: n * bs]  # SGLang's last page can be partial: it is not keyed
        try:
            keys = chain_keys(parent_key, tokens, bs)
        except (ValueError, TypeError, OverflowError):
            # token ids that are not uint32 ints: the event is malformed; it cannot be keyed
            self.stats.bad_tokens += 1
            return
        medium = ev.medium
        refs = self._refs
        held = self._medium
        changed = False
        gpu = medium == GPU
        for i in range(n):
            h = hashes[i]
            mk: EngineHash | tuple[EngineHash, str] = h if gpu else (h, medium)
            k = keys[i]
            old = mapping.get(mk)
            if old == k:
                continue
            changed = True
            if old is not None:
                self._unref(old, medium)
            mapping[mk] = k
            r = refs.get(k, 0)
            refs[k] = r + 1
            held[k] = medium
            if self._group0 is not None:  # the engine names groups: it may turn out hybrid
                self._link[k] = parent_key if i == 0 else keys[i - 1]
        self.stats.stored_blocks += n
        if changed and self.sink is not None:
            self.sink.stored(keys, parent_key, medium)
        if self._orphans:
            self._keyed(hashes[:n], medium)  # recovery.py: orphans below these blocks
        if len(mapping) > self.max_blocks:
            self._overflow()

    def _store_multi(self, ev: BlockStored, bs: int, ratio: int) -> None:
        """Keys over ``ratio`` engine blocks: the engine block that completes a key block holds
        its key; the others only carry the chain state (last key, tokens since) for their
        children. A key leaves the inventory when its completing engine block is removed (engines
        evict leaf first, so an earlier member going first is rare; the index may then overstate
        that replica's match by one key block)."""
        hashes = ev.block_hashes
        mapping = self._map
        partial = self._partial
        medium = ev.medium
        gpu = medium == GPU
        pending: tuple[int, ...] = ()
        if ev.parent is None:
            anchor = self._root(ev.lora_name, ev.cache_salt)
        else:
            found = mapping.get(ev.parent)
            if found is None and not gpu:
                found = mapping.get((ev.parent, medium))
            if found is not None:
                anchor = found
            else:
                state = partial.get(ev.parent)
                if state is None and not gpu:
                    state = partial.get((ev.parent, medium))
                if state is None:
                    self._skip(len(hashes))
                    return
                anchor, pending = state
        tokens = ev.token_ids
        n = min(len(hashes), len(tokens) // bs)
        kbs = bs * ratio
        new_keys: list[int] = []
        parent_key = anchor
        for i in range(n):
            h = hashes[i]
            mk: EngineHash | tuple[EngineHash, str] = h if gpu else (h, medium)
            pending = pending + tuple(tokens[i * bs : (i + 1) * bs])
            if len(pending) < kbs:
                partial[mk] = (anchor, pending)
                continue
            try:
                k = chain_keys(anchor, pending, kbs)[0]
            except (ValueError, TypeError, OverflowError):
                self.stats.bad_tokens += 1
                return
            if not new_keys:
                parent_key = anchor
            anchor, pending = k, ()
            old = mapping.get(mk)
            if old == k:
                continue
            if old is not None:
                self._unref(old, medium)
            mapping[mk] = k
            self._refs[k] = self._refs.get(k, 0) + 1
            self._medium[k] = medium
            new_keys.append(k)
        self.stats.stored_blocks += n
        if new_keys and self.sink is not None:
            self.sink.stored(new_keys, parent_key, medium)
        while len(partial) > self.max_blocks:
            partial.popitem(last=False)
            self.stats.overflow_evictions += 1
        if len(mapping) > self.max_blocks:
            self._overflow()

    def _drop_key(self, k: int) -> None:
        """``k``'s last reference went: it leaves the inventory (the caller reports it)."""
        del self._refs[k]
        del self._medium[k]
        self._link.pop(k, None)
        self._released(k)

    def _overflow(self) -> None:
        mapping = self._map
        dropped: list[int] = []
        while len(mapping) > self.max_blocks:
            _h, k = mapping.popitem(last=False)
            self.stats.overflow_evictions += 1
            r = self._refs[k] - 1
            if r:
                self._refs[k] = r
            else:
                self._drop_key(k)
                dropped.append(k)
        if dropped and self.sink is not None:
            self.sink.removed(dropped, GPU)

    def _unref(self, k: int, medium: str) -> None:
        r = self._refs[k] - 1
        if r:
            self._refs[k] = r
            return
        self._drop_key(k)
        if self.sink is not None:
            self.sink.removed([k], medium)

    def _remove(self, ev: BlockRemoved) -> None:
        medium = ev.medium or GPU
        gpu = medium == GPU
        mapping = self._map
        refs = self._refs
        gone: list[int] = []
        partial = self._partial
        orphans = self._orphans
        for h in ev.block_hashes:
            mk = h if gpu else (h, medium)
            k = mapping.pop(mk, None)
            if orphans:
                orphans.remove(mk)  # a block kept for adoption (recovery.py) is gone
            if k is None:
                if partial and partial.pop(mk, None) is not None:
                    continue  # an engine block inside a key block: it held no key
                self.stats.unknown_removals += 1
                continue
            r = refs[k] - 1
            if r and self._hashless:  # the engine lost k: no hint keeps it (recovery.py)
                r -= self._hashless.pop(k, 0)
            if r:
                refs[k] = r
            else:
                self._drop_key(k)
                gone.append(k)
        self.stats.removed_blocks += len(gone)
        if self.degraded:
            self._rebuild_left -= len(gone)
            if self._rebuild_left <= 0:
                self.mark_complete()
        if gone and self.sink is not None:
            self.sink.removed(gone, medium)
