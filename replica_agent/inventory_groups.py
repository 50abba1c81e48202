"""AgentInventory's handling of events from engines with KV-cache groups (vLLM hybrid-attention
models): when to switch to per-group tracking, and how stores and removals reach the
``GroupTracker`` (kv_groups.py, which says what is tracked and why; docs/architecture.md, agent).
"""

from __future__ import annotations

from typing import Any

from replica_agent.engine_events import BlockRemoved, BlockStored
from replica_agent.kv_groups import FULL, GroupTracker


class GroupedEvents:
    """AgentInventory's handling of engines with KV-cache groups (its attributes, declared here
    for the type checker; inventory.py owns them)."""

    block_size: int | None
    key_block_size: int | None
    max_blocks: int
    sink: Any
    stats: Any
    degraded: bool
    _rebuild_left: int
    _group0: int | None
    _groups: GroupTracker | None
    _map: Any
    _partial: Any
    _refs: dict[int, int]
    _medium: dict[int, str]
    _link: dict[int, int]
    _roots: dict[tuple[str | None, str | None], int]

    def _root(self, lora: str | None, salt: str | None) -> int:
        raise NotImplementedError

    def _skip(self, blocks: int) -> None: ...

    def mark_complete(self) -> None: ...

    def _forget_recovery(self) -> None: ...

    def _needs_groups(self, ev: BlockStored) -> bool:
        """A block of a second group, or of a group that is not full attention: per-group
        tracking from here on (kv_groups.py)."""
        if self._group0 is None:
            self._group0 = ev.group
        return ev.group != self._group0 or (ev.spec_kind is not None and ev.spec_kind != FULL)

    def _switch_to_groups(self) -> None:
        """Hand the blocks tracked so far (all of ``_group0``, full attention) to a group
        tracker, silently: they stay reported until the new groups say otherwise."""
        assert self.block_size is not None  # a BlockStored was seen
        self._groups = GroupTracker(self.block_size, self.max_blocks, self.sink)
        if self._map:
            self._groups.adopt(
                self._group0 or 0, self._map, self._link, set(self._roots.values()), self._medium
            )
        self._forget_recovery()  # no recovery per group (recovery.py)
        self._map.clear()
        self._partial.clear()
        self._refs.clear()
        self._medium.clear()
        self._link.clear()

    def _store_grouped(self, ev: BlockStored, groups: GroupTracker) -> None:
        bs = self.block_size
        if bs is None or ev.block_size != bs or (self.key_block_size not in (None, bs)):
            self.stats.block_size_mismatches += 1  # hybrid engines are keyed at their block size
            return
        if ev.parent is None:
            parent_key = self._root(ev.lora_name, ev.cache_salt)
        else:
            found = groups.key_of.get(ev.parent)
            if found is None and ev.medium != "GPU":
                found = groups.key_of.get((ev.parent, ev.medium))
            if found is None:
                self._skip(len(ev.block_hashes))
                return
            parent_key = found
        before = groups.overflow_evictions
        stored = groups.store(ev, parent_key, self._group0 or 0)
        self.stats.overflow_evictions += groups.overflow_evictions - before
        if stored is None:
            self.stats.bad_tokens += 1
        else:
            self.stats.stored_blocks += stored

    def _remove_grouped(self, ev: BlockRemoved, groups: GroupTracker) -> None:
        medium = ev.medium or "GPU"
        gpu = medium == "GPU"
        group = ev.group if ev.group is not None else (self._group0 or 0)
        if group not in groups.need:
            self.stats.unknown_removals += len(ev.block_hashes)
            return
        mks = [h if gpu else (h, medium) for h in ev.block_hashes]
        translated, unknown = groups.release(group, mks, medium)
        self.stats.removed_blocks += translated
        self.stats.unknown_removals += unknown
        if self.degraded:
            self._rebuild_left -= translated
            if self._rebuild_left <= 0:
                self.mark_complete()
