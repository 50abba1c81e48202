"""A least-recently-used map bounded in entries and in bytes (docs/architecture.md, "Request
path": features): the segment cache (``segment_encoder.BoundedLRU``) and the memo of pure steps
(``memo_cache.MemoCache``) are both one of these.

``capacity`` entries at most (0 disables it) and ``max_bytes`` bytes at most (None: no byte
bound), each entry's bytes given by ``size_of(key, value)``. An entry larger than the byte bound
is not kept. Invariant: ``bytes <= max_bytes`` and ``len <= capacity`` after every ``put``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from gateway.features.budgets import non_negative

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    def __init__(self, capacity: int, max_bytes: int | None, size_of: Callable[[K, V], int]) -> None:
        non_negative(capacity=capacity, max_bytes=max_bytes)
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self._size_of = size_of
        self._data: OrderedDict[K, V] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._data)

    def peek(self, key: K) -> V | None:
        """The entry, without counting a hit or miss and without refreshing it."""
        return self._data.get(key)

    def get(self, key: K) -> V | None:
        value = self._data.get(key)
        if value is None:
            self.misses += 1
            return None
        self._data.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: K, value: V) -> None:
        size = self._size_of(key, value)
        if self.capacity == 0 or (self.max_bytes is not None and size > self.max_bytes):
            return
        old = self._data.pop(key, None)
        if old is not None:
            self.bytes -= self._size_of(key, old)
        self._data[key] = value
        self.bytes += size
        limit = self.max_bytes
        while len(self._data) > self.capacity or (limit is not None and self.bytes > limit):
            k, v = self._data.popitem(last=False)
            self.bytes -= self._size_of(k, v)
            self.evictions += 1
        assert limit is None or self.bytes <= limit

    def clear(self) -> None:
        self._data.clear()
        self.bytes = 0
