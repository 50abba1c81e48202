"""Deltas waiting to go to the gateway: the agent inventory's sink.

Invariants
* While no stream is open (``open`` false) deltas are dropped: the next stream starts with a full
  snapshot, taken in the same synchronous step that reopens the outbox, so the snapshot plus the
  deltas queued after it are exactly the inventory.
* At most ``max_events`` events wait. Past that the queue is dropped and ``need_snapshot`` set:
  a snapshot replaces any number of lost deltas, so a slow gateway costs a resync, never memory.
* ``wake`` is set whenever there is something to send.
"""

from __future__ import annotations

import asyncio

from proto.contract import wire_medium
from proto.kvgate.v1 import inventory_pb2 as pb


class Outbox:
    def __init__(self, max_events: int = 100_000) -> None:
        if max_events <= 0:
            raise ValueError("max_events must be positive")
        self.max_events = max_events
        self.events: list[pb.Event] = []
        self.engine_ts = 0.0
        self.open = False
        self.need_snapshot = False
        self.overflows = 0
        self.wake = asyncio.Event()

    def reopen(self) -> None:
        """A snapshot is being taken now: start queueing from here."""
        self.events = []
        self.open = True
        self.need_snapshot = False

    def close(self) -> None:
        self.events = []
        self.open = False

    def take(self) -> list[pb.Event]:
        events, self.events = self.events, []
        return events

    def _push(self, ev: pb.Event) -> None:
        if not self.open or self.need_snapshot:
            return
        events = self.events
        events.append(ev)
        if len(events) > self.max_events:
            self.events = []
            self.need_snapshot = True
            self.overflows += 1
        self.wake.set()

    # InventorySink
    def stored(self, keys: list[int], parent: int | None, medium: str) -> None:
        if self.open and not self.need_snapshot:
            st = pb.Stored(keys=keys, medium=wire_medium(medium))
            if parent is not None:
                st.parent_key = parent
            self._push(pb.Event(stored=st))

    def removed(self, keys: list[int], medium: str) -> None:
        if self.open and not self.need_snapshot:
            self._push(pb.Event(removed=pb.Removed(keys=keys, medium=wire_medium(medium))))

    def cleared(self) -> None:
        if self.open and not self.need_snapshot:
            self._push(pb.Event(cleared=pb.Cleared()))
