"""The numba-compiled kernels of ``BlockTable`` (``block_table.py``, whose docstring states the
layout and the invariants every kernel keeps). Each takes the table's arrays (most as one ``Table``
tuple: numba unboxes it as fast as separate arrays) and works in place;
integer arithmetic stays in uint64/int64 (numba would promote a uint64/int64 mix to float64).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
# (keys, state, masks, shift): a table's arrays and its hash shift, passed as one argument
Table = tuple[U64, U8, U64, np.uint64]

_GOLD = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads small or structured keys

F = TypeVar("F", bound=Callable[..., Any])


def _compiled(fn: F) -> F:
    return cast(F, numba.njit(cache=True, nogil=True)(fn))


@_compiled
def _probe(keys: U64, state: U8, shift: np.uint64, key: np.uint64) -> int:
    """The slot of ``key``, or the empty slot where it would go."""
    last = keys.shape[0] - 1
    i = np.int64((key * _GOLD) >> shift)
    while state[i] != 0 and keys[i] != key:
        i = (i + 1) & last
    return int(i)


@_compiled
def _alive(masks: U64, i: int) -> bool:
    for w in range(masks.shape[0]):  # noqa: SIM110 (numba compiles loops, not generators)
        if masks[w, i] != 0:
            return True
    return False


@_compiled
def k_set(t: Table, batch: U64, word: int, bit: np.uint64, newly: I64) -> tuple[int, int, int]:
    """Set ``bit`` of ``word`` for every key of ``batch``, inserting absent keys. The slots whose
    bit was newly set go to ``newly[:n]``. Returns (n, slots newly used, keys newly live)."""
    keys, state, masks, shift = t
    n = 0
    fresh = 0
    live = 0
    for j in range(batch.shape[0]):
        key = batch[j]
        i = _probe(keys, state, shift, key)
        if state[i] == 0:
            state[i] = 1
            keys[i] = key
            fresh += 1
        m = masks[word, i]
        if (m & bit) == 0:
            if not _alive(masks, i):
                live += 1
            masks[word, i] = m | bit
            newly[n] = i
            n += 1
    return n, fresh, live


@_compiled
def k_unset_slots(masks: U64, slots: I64, word: int, bit: np.uint64) -> int:
    """Clear ``bit`` in the given slots (an undo of ``k_set``). Returns keys no longer live."""
    dead = 0
    inv = ~bit
    for j in range(slots.shape[0]):
        i = slots[j]
        if (masks[word, i] & bit) != 0:
            masks[word, i] &= inv
            if not _alive(masks, i):
                dead += 1
    return dead


@_compiled
def k_unset(t: Table, batch: U64, word: int, bit: np.uint64) -> tuple[int, int]:
    """Clear ``bit`` for every key of ``batch`` that has it. Returns (bits cleared, keys no
    longer live)."""
    keys, state, masks, shift = t
    cleared = 0
    dead = 0
    inv = ~bit
    for j in range(batch.shape[0]):
        i = _probe(keys, state, shift, batch[j])
        if state[i] != 0 and (masks[word, i] & bit) != 0:
            masks[word, i] &= inv
            cleared += 1
            if not _alive(masks, i):
                dead += 1
    return cleared, dead


@_compiled
def k_has(t: Table, batch: U64, word: int, bit: np.uint64) -> U8:
    """1 where the key of ``batch`` has ``bit`` set, else 0."""
    keys, state, masks, shift = t
    out = np.zeros(batch.shape[0], dtype=np.uint8)
    for j in range(batch.shape[0]):
        i = _probe(keys, state, shift, batch[j])
        if state[i] != 0 and (masks[word, i] & bit) != 0:
            out[j] = 1
    return out


@_compiled
def k_absent(t: Table, batch: U64) -> int:
    """How many keys of ``batch`` have no used slot (a dead key's slot is reused): the slots an
    insert of ``batch`` may take (a key repeated in ``batch`` counts each time, never fewer)."""
    keys, state, _masks, shift = t
    n = 0
    for j in range(batch.shape[0]):
        if state[_probe(keys, state, shift, batch[j])] == 0:
            n += 1
    return n


@_compiled
def k_mask_of(t: Table, key: np.uint64) -> U64:
    keys, state, masks, shift = t
    out = np.zeros(masks.shape[0], dtype=np.uint64)
    i = _probe(keys, state, shift, key)
    if state[i] != 0:
        for w in range(masks.shape[0]):
            out[w] = masks[w, i]
    return out


@_compiled
def k_match(t: Table, batch: U64) -> I64:
    """Per replica slot, the length of its leading run of ``batch`` (0: no match). The walk
    stops as soon as no replica is still matching."""
    keys, state, masks, shift = t
    words = masks.shape[0]
    runs = np.zeros(words * 64, dtype=np.int64)
    alive = np.zeros(words, dtype=np.uint64)
    n = batch.shape[0]
    any_alive = False
    i0 = _probe(keys, state, shift, batch[0])
    if state[i0] != 0:
        for w in range(words):
            alive[w] = masks[w, i0]
            if alive[w] != 0:
                any_alive = True
    j = 1
    while any_alive and j < n:
        i = _probe(keys, state, shift, batch[j])
        used = state[i] != 0
        any_alive = False
        for w in range(words):
            a = alive[w]
            if a == 0:
                continue
            nxt = a & masks[w, i] if used else np.uint64(0)
            dropped = a & ~nxt
            while dropped != 0:
                low = dropped & (~dropped + np.uint64(1))
                b = 0
                while (low >> np.uint64(b)) != np.uint64(1):
                    b += 1
                runs[w * 64 + b] = j
                dropped ^= low
            alive[w] = nxt
            if nxt != 0:
                any_alive = True
        j += 1
    for w in range(words):
        a = alive[w]
        for b in range(64):
            if (a >> np.uint64(b)) & np.uint64(1):
                runs[w * 64 + b] = n
    return runs


@_compiled
def k_deepest(t: Table, batch: U64, only: U64) -> I64:
    """Per replica slot of ``only`` (one mask per word), 1 + the position of the deepest key of
    ``batch`` it holds (0: none). Walks from the end; stops once every slot of ``only`` is found."""
    keys, state, masks, shift = t
    words = masks.shape[0]
    deepest = np.zeros(words * 64, dtype=np.int64)
    left = only.copy()
    j = batch.shape[0] - 1
    while j >= 0:
        i = _probe(keys, state, shift, batch[j])
        if state[i] != 0:
            pending = False
            for w in range(words):
                hit = masks[w, i] & left[w]
                left[w] &= ~hit
                while hit != 0:
                    low = hit & (~hit + np.uint64(1))
                    b = 0
                    while (low >> np.uint64(b)) != np.uint64(1):
                        b += 1
                    deepest[w * 64 + b] = j + 1
                    hit ^= low
                if left[w] != 0:
                    pending = True
            if not pending:
                break
        j -= 1
    return deepest


@_compiled
def k_keys_with(keys: U64, state: U8, masks: U64, word: int, bit: np.uint64) -> U64:
    """Every key that has ``bit`` of ``word`` set, in slot order."""
    n = 0
    row = masks[word]
    for i in range(keys.shape[0]):
        if state[i] != 0 and (row[i] & bit) != 0:
            n += 1
    out = np.empty(n, dtype=np.uint64)
    n = 0
    for i in range(keys.shape[0]):
        if state[i] != 0 and (row[i] & bit) != 0:
            out[n] = keys[i]
            n += 1
    return out


@_compiled
def k_rehash(old: Table, new: Table) -> int:
    """Insert the live keys of the old table into the new (empty) one, probing with the new
    table's shift. Returns keys moved."""
    keys, state, masks, _ = old
    new_keys, new_state, new_masks, shift = new
    moved = 0
    words = masks.shape[0]
    for i in range(keys.shape[0]):
        if state[i] != 0 and _alive(masks, i):
            j = _probe(new_keys, new_state, shift, keys[i])
            new_state[j] = 1
            new_keys[j] = keys[i]
            for w in range(words):
                new_masks[w, j] = masks[w, i]
            moved += 1
    return moved
