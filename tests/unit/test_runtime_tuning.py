from __future__ import annotations

import gc

from gateway.runtime_tuning import settle_heap


def test_settle_heap_freezes_the_survivors() -> None:
    try:
        frozen = settle_heap()
        assert frozen > 0 and gc.get_freeze_count() == frozen
        assert gc.get_count()[2] == 0  # the oldest generation holds nothing left to walk
    finally:
        gc.unfreeze()
