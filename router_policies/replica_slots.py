"""The replicas a prefix index tracks and their slots (docs/architecture.md, "The index"): slot
``s`` is bit ``s`` of the index's per-key replica masks. Shared by ``PrefixIndex`` and the
pre-numba reference index (``bench/dict_prefix_index.py``), so that both number replicas alike.

Invariants
* ``records`` and ``by_slot`` are inverse maps of the same replicas; a slot is in use by at most
  one replica, and at most ``limit`` slots are ever numbered (the masks' width).
* A freed slot is reused before a new one is numbered (last freed first), so slots stay dense.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from router_policies.index_types import IndexBoundError, UnknownReplicaError


class Slotted(Protocol):
    slot: int


R = TypeVar("R", bound=Slotted)


class ReplicaSlots(Generic[R]):
    """Replica name -> its record (which holds its slot), and slot -> replica name."""

    __slots__ = ("_free", "_limit", "_next", "by_slot", "records")

    def __init__(self, limit: int) -> None:
        self.records: dict[str, R] = {}
        self.by_slot: dict[int, str] = {}
        self._free: list[int] = []
        self._next = 0
        self._limit = limit

    def add(self, replica: str, make: Callable[[int], R]) -> None:
        """Track ``replica`` with the record ``make(slot)``; nothing if it is tracked already.
        Raises ``IndexBoundError`` (nothing changed) when all ``limit`` slots are in use."""
        if replica in self.records:
            return
        if self._free:
            slot = self._free.pop()
        else:
            if self._next >= self._limit:
                raise IndexBoundError(f"index already tracks max_replicas={self._limit}")
            slot = self._next
            self._next += 1
        self.records[replica] = make(slot)
        self.by_slot[slot] = replica

    def record(self, replica: str) -> R:
        """The record of ``replica``; raises ``UnknownReplicaError`` when it is not tracked (an
        index adds replicas only through ``add``, never as a side effect of a store or touch)."""
        rep = self.records.get(replica)
        if rep is None:
            raise UnknownReplicaError(f"the index does not track replica {replica!r}")
        return rep

    def release(self, replica: str) -> R:
        """Stop tracking ``replica`` (tracked) and free its slot; returns its record."""
        rep = self.records.pop(replica)
        del self.by_slot[rep.slot]
        self._free.append(rep.slot)
        return rep

    def selected(self, replica: str | None) -> list[R]:
        """The record of ``replica`` (tracked), or every record when None."""
        return [self.records[replica]] if replica is not None else list(self.records.values())
