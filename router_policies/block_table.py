"""A compact hash table from 64-bit block key to a bit mask of replica slots (the prefix index's
storage, docs/architecture.md, "The index").

Layout: open addressing with linear probing over three numpy arrays of ``capacity`` slots,
``capacity`` a power of two:

* ``keys``   uint64 — the block key of a used slot;
* ``state``  uint8  — 0 empty, 1 used (a used slot may hold an all-zero mask: a *dead* key,
  kept so that the probe chains through it stay intact and reused if the key comes back);
* ``masks``  uint64[words, capacity] — bit ``s % 64`` of row ``s // 64`` is set iff replica slot
  ``s`` holds the key. ``words`` grows with the highest replica slot in use.

That is ``9 + 8 * words`` bytes per slot; the table is rebuilt (dead keys dropped) or grown when
used slots would exceed ``MAX_LOAD`` of the capacity (``reserve``): right after a growth a live
key costs less than ``4 * (9 + 8 * words)`` bytes (68 at one word, up to 64 replicas), about
``(9 + 8 * words) / (MAX_LOAD / 2)`` (49) when the table grew by batches small beside it, and
less as it fills. Keys a batch brings that the table already holds (another replica's blocks)
take no slot and are not counted as incoming.

The kernels are compiled with numba (``nopython``, cached on disk) because the per-call cost of
a dozen numpy operations (~30 us) dominates event batches of a few keys; a compiled loop costs
~1 us per call plus a few ns per key. Every kernel keeps integer arithmetic in uint64/int64 (numba
would promote a uint64/int64 mix to float64).

Invariants
* A key occupies at most one used slot, found by probing from ``hash(key)`` up to the first
  empty slot; no kernel ever empties a used slot (only ``rebuilt`` drops dead keys).
* ``live`` counts used slots whose mask is non-zero; ``used`` counts used slots.
* The caller guarantees room before an inserting kernel runs (``reserve``), so probing always
  terminates on an empty slot.
* ``arrays`` is always ``(keys, state, masks, shift)``, the kernels' ``Table`` (asserted by
  tests/unit/test_block_table.py).
"""

from __future__ import annotations

import array
from collections.abc import Iterable
from typing import Any

import numpy as np

from router_policies.block_kernels import (
    I64,
    U8,
    U64,
    Table,
    k_absent,
    k_deepest,
    k_has,
    k_keys_with,
    k_mask_of,
    k_match,
    k_rehash,
    k_set,
    k_unset,
    k_unset_slots,
)

MAX_LOAD = 0.7
MIN_BITS = 10


def as_keys(keys: Any) -> U64:
    """Block keys (any sequence of ints in [0, 2**64), or a uint64 array) as a uint64 array."""
    if isinstance(keys, np.ndarray) and keys.dtype == np.uint64:
        # the kernels are compiled (and warmed) for writable C-contiguous arrays; another layout
        # would compile a second specialisation inside the first call that passes one
        return keys if keys.flags.c_contiguous and keys.flags.writeable else keys.copy()
    # array.array converts a list of ints in one C loop, faster than np.array's generic path
    return np.frombuffer(array.array("Q", keys), dtype=np.uint64)


class BlockTable:
    """The arrays and their counters; methods map one-to-one to kernels and keep the counters."""

    __slots__ = ("_newly", "arrays", "bits", "keys", "live", "masks", "shift", "state", "used")

    def __init__(self, bits: int = MIN_BITS, words: int = 1) -> None:
        self.bits = bits
        self.shift = np.uint64(64 - bits)
        self.keys: U64 = np.zeros(1 << bits, dtype=np.uint64)
        self.state: U8 = np.zeros(1 << bits, dtype=np.uint8)
        self.masks: U64 = np.zeros((words, 1 << bits), dtype=np.uint64)
        # the kernels' view of the four above; rebuilt wherever one of them is replaced
        self.arrays: Table = (self.keys, self.state, self.masks, self.shift)
        self.used = 0
        self.live = 0
        self._newly: I64 = np.empty(64, dtype=np.int64)
        self._warm()

    def _warm(self) -> None:
        """Call every kernel once on the empty table, so that loading (or, on a fresh checkout,
        compiling) the machine code happens here, at start-up, not inside the first request.
        Costs a few microseconds once the process has loaded them."""
        probe = np.zeros(1, dtype=np.uint64)
        self.has(probe, 0)
        self.match(probe)
        self.deepest(probe, (0,))
        self.mask_of(0)
        self.keys_of(0)
        self.unset(probe, 0)
        self.unset_slots(np.empty(0, dtype=np.int64), 0)
        k_absent(self.arrays, probe)
        scratch: Table = (self.keys.copy(), self.state.copy(), self.masks.copy(), self.shift)
        k_set(scratch, probe, 0, np.uint64(1), self._newly)
        k_rehash(self.arrays, (self.keys.copy(), self.state.copy(), self.masks.copy(), self.shift))

    @property
    def capacity(self) -> int:
        return 1 << self.bits

    @property
    def words(self) -> int:
        return int(self.masks.shape[0])

    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.state.nbytes + self.masks.nbytes)

    def ensure_words(self, words: int) -> None:
        """Make room for replica slots below ``64 * words``."""
        if words > self.words:
            grown = np.zeros((words, self.capacity), dtype=np.uint64)
            grown[: self.words] = self.masks
            self.masks = grown
            self.arrays = (self.keys, self.state, self.masks, self.shift)

    def reserve(self, batch: U64) -> None:
        """Guarantee that the keys of ``batch`` fit under ``MAX_LOAD``: drop dead keys, and
        double the capacity while the live ones and the incoming would fill more than half of
        it. Incoming are the keys without a slot, counted only near the limit (a replica storing
        keys another already holds takes no new slot). So right after a growth the load is above
        1/4 and at most 1/2: a live key costs less than ``4 * slot`` bytes (68 at one mask word);
        a table grown by batches small beside it doubles once, from ``MAX_LOAD`` to a load of
        about ``MAX_LOAD / 2`` (49 bytes a key)."""
        if self.used + len(batch) <= MAX_LOAD * self.capacity:
            return
        incoming = k_absent(self.arrays, batch)
        if self.used + incoming <= MAX_LOAD * self.capacity:
            return
        bits = self.bits
        while self.live + incoming > (1 << bits) / 2:
            bits += 1
        new_keys = np.zeros(1 << bits, dtype=np.uint64)
        new_state = np.zeros(1 << bits, dtype=np.uint8)
        new_masks = np.zeros((self.words, 1 << bits), dtype=np.uint64)
        shift = np.uint64(64 - bits)
        new: Table = (new_keys, new_state, new_masks, shift)
        moved = k_rehash(self.arrays, new)
        self.keys, self.state, self.masks = new_keys, new_state, new_masks
        self.bits, self.shift = bits, shift
        self.arrays = new
        self.used = self.live = moved

    def set(self, batch: U64, slot: int) -> I64:
        """Give replica ``slot`` every key of ``batch``; returns the table slots it newly got."""
        self.ensure_words((slot >> 6) + 1)
        self.reserve(batch)
        if len(self._newly) < len(batch):
            self._newly = np.empty(max(len(batch), 2 * len(self._newly)), dtype=np.int64)
        n, fresh, live = k_set(self.arrays, batch, slot >> 6, np.uint64(1 << (slot & 63)), self._newly)
        self.used += fresh
        self.live += live
        return self._newly[:n]

    def unset_slots(self, slots: I64, slot: int) -> None:
        self.live -= k_unset_slots(self.masks, slots, slot >> 6, np.uint64(1 << (slot & 63)))

    def unset(self, batch: U64, slot: int) -> int:
        """Take every key of ``batch`` from replica ``slot``; returns how many it held."""
        if slot >> 6 >= self.words:
            return 0
        cleared, dead = k_unset(self.arrays, batch, slot >> 6, np.uint64(1 << (slot & 63)))
        self.live -= dead
        return int(cleared)

    def has(self, batch: U64, slot: int) -> U8:
        if slot >> 6 >= self.words:
            return np.zeros(len(batch), dtype=np.uint8)
        return k_has(self.arrays, batch, slot >> 6, np.uint64(1 << (slot & 63)))

    def mask_of(self, key: int) -> int:
        words = k_mask_of(self.arrays, np.uint64(key))
        return sum(int(m) << (64 * w) for w, m in enumerate(words.tolist()))

    def match(self, batch: U64) -> I64:
        return k_match(self.arrays, batch)

    def deepest(self, batch: U64, slots: Iterable[int]) -> I64:
        """Per slot (of ``slots``; others 0), 1 + the position of the deepest key of ``batch``
        it holds (0: none)."""
        only = np.zeros(self.words, dtype=np.uint64)
        for s in slots:
            if s >> 6 < self.words:
                only[s >> 6] |= np.uint64(1 << (s & 63))
        if batch.size == 0:
            return np.zeros(self.words * 64, dtype=np.int64)
        return k_deepest(self.arrays, batch, only)

    def keys_of(self, slot: int) -> U64:
        if slot >> 6 >= self.words:
            return np.empty(0, dtype=np.uint64)
        return k_keys_with(self.keys, self.state, self.masks, slot >> 6, np.uint64(1 << (slot & 63)))


# Load (on a fresh checkout: compile, then cache on disk) every kernel once at import, on a
# throw-away table: the first table built afterwards — inside a request, or inside a timed test —
# must not pay the ~0.3-1 s of loading machine code. Nothing is kept.
BlockTable()
