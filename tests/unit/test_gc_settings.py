"""The collector settings of the gateway and the agent (router_policies/gc_settings.py)."""

from __future__ import annotations

import gc

from router_policies.gc_settings import GC_GEN0_THRESHOLD, freeze_startup_heap


def test_the_startup_heap_is_frozen_and_young_collections_are_rarer() -> None:
    before = gc.get_threshold()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_GEN0_THRESHOLD, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
