"""Speculative touches relayed between workers, applied in batches (docs/architecture.md,
"Workers").

Every process holds an index copy, so each routed request's speculative touch is applied once per
process. ``PrefixIndex.touch_approximate`` costs mostly per call at the approximate LRU's cap
(~0.15-0.4 ms for one 128-block prompt, ~0.07 ms a prompt when 4 or more go in one call), so
the relayed ones are applied together: a batch per (replica, lifetime) is one call with the
prompts' keys concatenated, the newest first (a touch orders its keys leaf first, so the newest
prompt ends most recent, and a block shared by several ends where its newest prompt puts it).

Order: the parent (``TouchBatcher`` with a window) applies a batch and only then relays its
frames, so every worker receives the touches in the order the parent applied them, between the
same inventory frames; a worker applies its batch before any other frame (``flush``), so its copy
goes through the same sequence as the parent's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router_policies.prefix_index import PrefixIndex

TOUCH_WINDOW_S = 0.002  # the parent gathers relayed touches this long before applying them


@dataclass(slots=True)
class Touch:
    replica: str
    keys: list[int]
    lifetime_s: float
    origin: int = -1  # the worker it came from (the parent relays it to the others)
    frame: bytes = b""  # its frame, relayed as it came


@dataclass(eq=False)
class TouchBatcher:
    """Touches waiting to be applied together (one writer: the process's event loop)."""

    index: PrefixIndex
    known: Callable[[str], bool]  # the replica is in this process's fleet
    applied: Callable[[list[Touch]], None] = lambda _batch: None  # after a batch is applied
    window_s: float = 0.0  # 0: at the end of the event loop's turn
    _pending: list[Touch] = field(default_factory=list)
    _keys: int = 0
    _timer: asyncio.Handle | None = None

    def add(self, touch: Touch) -> None:
        # a batch stays within the LRU's cap: one that this touch would take over half of it goes
        # first (a touch longer than the cap alone keeps its head only, as when applied alone)
        half = max(1, self.index.config.approximate_blocks_per_replica // 2)
        if self._pending and self._keys + len(touch.keys) > half:
            self.flush()
        self._pending.append(touch)
        self._keys += len(touch.keys)
        if self._keys >= half:
            self.flush()
        elif self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = (
                loop.call_later(self.window_s, self.flush) if self.window_s else loop.call_soon(self.flush)
            )

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._pending:
            return
        batch, self._pending, self._keys = self._pending, [], 0
        groups: dict[tuple[str, float], list[list[int]]] = {}
        for t in batch:
            groups.setdefault((t.replica, t.lifetime_s), []).append(t.keys)
        now = time.monotonic()
        for (replica, lifetime), chains in groups.items():
            if self.known(replica):
                keys = [k for chain in reversed(chains) for k in chain]
                self.index.touch_approximate(replica, keys, now, lifetime)
        self.applied(batch)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._pending.clear()
