"""The prediction audit's recovery hint (gateway/prediction_audit.py:held_prefix_hint): which keys
the engine's cached-token report says it holds, and the tokens of the first block it stored."""

from __future__ import annotations

import numpy as np

from gateway.prediction_audit import held_prefix_hint


def test_hint_names_the_held_keys_and_the_next_block() -> None:
    tokens = np.arange(10, dtype=np.uint32)  # blocks of 2: keys k0..k4
    keys = [100, 101, 102, 103, 104]
    assert held_prefix_hint(keys, tokens, 2, 4) == ([100, 101], [4, 5])
    assert held_prefix_hint(keys, tokens, 2, 5) == ([100, 101], [4, 5])  # whole blocks only


def test_no_hint_when_it_would_teach_nothing() -> None:
    tokens = np.arange(10, dtype=np.uint32)
    keys = [100, 101, 102, 103, 104]
    assert held_prefix_hint(keys, tokens, 2, 0) is None  # nothing cached: the first block is a root
    assert held_prefix_hint(keys, tokens, 2, 1) is None
    assert held_prefix_hint(keys, tokens, 2, 10) is None  # all cached: nothing new stored
    assert held_prefix_hint(keys, None, 2, 4) is None  # tokens unknown (approximate keys)
    assert held_prefix_hint(keys, tokens[:5], 2, 4) is None  # the next block is not whole
