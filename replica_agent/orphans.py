"""Stored blocks the agent could not key yet: their parent's engine hash is unknown (the agent
restarted beside a warm engine whose replay buffer no longer reaches back, or an event gap could
not be replayed). Kept, bounded in bytes, until the parent is learnt from a gateway hint and the
blocks are adopted (docs/agent.md, "Recovery without replay"; docs/architecture.md, agent).

Invariants
* ``_bytes`` is the estimated size of the events held and never exceeds ``max_bytes`` after
  ``add`` returns: the oldest events go first.
* ``_by_block[h]`` holds every held event whose held blocks include ``h``, oldest first (a
  block stored twice, as vLLM keeps duplicate copies, is held by each copy's event, and each
  removal takes it from the oldest); every held event is in ``_by_parent[its parent]`` and
  ``_by_first[its first block's tokens]``; an event leaves all three at once.
* An event only loses blocks from its end (a removal truncates it at the removed block): engines
  evict leaf first, so what is left is a chain the engine may still hold.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

from replica_agent.engine_events import BlockStored, EngineHash

MapKey = EngineHash | tuple[EngineHash, str]
EVENT_OVERHEAD_BYTES = 240  # the record, its dict slots and list headers
BLOCK_BYTES = 120  # per block: its hash object and the index entry pointing to it
TOKEN_BYTES = 9  # per token id: a list slot (small ints are shared)


def map_key(h: EngineHash, medium: str, gpu: bool) -> MapKey:
    return h if gpu else (h, medium)


K = TypeVar("K")


def _unlist(index: dict[K, dict[int, Orphan]], k: K, o: Orphan) -> None:
    group = index[k]
    del group[id(o)]
    if not group:
        del index[k]


@dataclass(slots=True, eq=False)
class Orphan:
    """One BlockStored whose parent is unknown, possibly truncated by removals."""

    event: BlockStored
    parent: MapKey
    blocks: int  # leading blocks of the event still held
    size: int  # estimated bytes

    def held(self) -> BlockStored:
        """The event as far as the engine still holds it."""
        ev = self.event
        bs = ev.block_size
        if self.blocks == len(ev.block_hashes):
            return ev
        return BlockStored(
            ev.block_hashes[: self.blocks],
            ev.parent,
            ev.token_ids[: self.blocks * bs],
            bs,
            lora_name=ev.lora_name,
            medium=ev.medium,
            cache_salt=ev.cache_salt,
        )


class OrphanStores:
    """Orphan stored events by parent hash, by first block's tokens and by block hash."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self._events: OrderedDict[int, Orphan] = OrderedDict()  # id -> orphan, oldest first
        self._by_parent: dict[MapKey, dict[int, Orphan]] = {}
        self._by_first: dict[tuple[int, ...], dict[int, Orphan]] = {}
        self._by_block: dict[MapKey, dict[int, Orphan]] = {}
        self._bytes = 0
        self.dropped = 0  # events dropped by the byte bound

    def __len__(self) -> int:
        return len(self._events)

    @property
    def bytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        self._events.clear()
        self._by_parent.clear()
        self._by_first.clear()
        self._by_block.clear()
        self._bytes = 0

    def add(self, ev: BlockStored, parent: MapKey) -> None:
        n = min(len(ev.block_hashes), len(ev.token_ids) // ev.block_size)
        if n == 0:
            return
        gpu = ev.medium == "GPU"
        size = EVENT_OVERHEAD_BYTES + BLOCK_BYTES * n + TOKEN_BYTES * len(ev.token_ids)
        o = Orphan(ev, parent, n, size)
        self._events[id(o)] = o
        self._by_parent.setdefault(parent, {})[id(o)] = o
        self._by_first.setdefault(self._first(o), {})[id(o)] = o
        for h in ev.block_hashes[:n]:
            self._by_block.setdefault(map_key(h, ev.medium, gpu), {})[id(o)] = o
        self._bytes += size
        while self._bytes > self.max_bytes and self._events:
            self._drop(next(iter(self._events.values())))
            self.dropped += 1

    @staticmethod
    def _first(o: Orphan) -> tuple[int, ...]:
        return tuple(o.event.token_ids[: o.event.block_size])

    def _drop(self, o: Orphan) -> None:
        del self._events[id(o)]
        _unlist(self._by_parent, o.parent, o)
        _unlist(self._by_first, self._first(o), o)
        ev = o.event
        gpu = ev.medium == "GPU"
        for h in ev.block_hashes[: o.blocks]:
            _unlist(self._by_block, map_key(h, ev.medium, gpu), o)
        self._bytes -= o.size

    def remove(self, mk: MapKey) -> bool:
        """The engine evicted block ``mk``: truncate its event there (True if it was held). A block
        held by several events (copies) is taken from the oldest: the engine evicts in free order."""
        holders = self._by_block.get(mk)
        if not holders:
            return False
        o = next(iter(holders.values()))
        ev = o.event
        gpu = ev.medium == "GPU"
        at = next(i for i in range(o.blocks) if map_key(ev.block_hashes[i], ev.medium, gpu) == mk)
        if at == 0:
            self._drop(o)
            return True
        for h in ev.block_hashes[at : o.blocks]:
            _unlist(self._by_block, map_key(h, ev.medium, gpu), o)
        o.blocks = at
        return True

    def take_children(self, parent: MapKey) -> list[BlockStored]:
        """Remove and return the events whose parent is ``parent`` (oldest first)."""
        group = self._by_parent.get(parent)
        if not group:
            return []
        out = list(group.values())  # insertion order: oldest first
        held = [o.held() for o in out]
        for o in out:
            self._drop(o)
        return held

    def parents_starting(self, first_tokens: tuple[int, ...]) -> set[MapKey]:
        """The parents of the held events whose first block is ``first_tokens``."""
        group = self._by_first.get(first_tokens)
        return {o.parent for o in group.values()} if group else set()
