"""``BlockTable``'s kernels' view of its arrays follows every growth (router_policies/block_table.py,
docs/architecture.md, "The index")."""

from __future__ import annotations

import numpy as np

from router_policies.block_table import BlockTable, as_keys


def _view_is_current(t: BlockTable) -> bool:
    keys, state, masks, shift = t.arrays
    return keys is t.keys and state is t.state and masks is t.masks and shift == t.shift


def test_kernel_view_follows_rehash_and_new_mask_words() -> None:
    t = BlockTable(bits=4)
    assert _view_is_current(t)
    keys = as_keys(range(1, 200))
    t.set(keys, 3)  # 199 keys in 16 slots: doubles several times
    assert t.capacity >= 256 and _view_is_current(t)
    t.set(keys[:10], 130)  # slot 130 needs a third mask word
    assert t.words == 3 and _view_is_current(t)
    assert t.has(keys, 3).all() and t.has(keys[:10], 130).all() and not t.has(keys[10:], 130).any()
    assert np.array_equal(np.sort(t.keys_of(130)), np.sort(keys[:10]))
    assert t.mask_of(5) == (1 << 3) | (1 << 130)
