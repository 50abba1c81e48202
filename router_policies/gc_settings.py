"""The cycle collector's settings for kvgate's long-running processes (the gateway, its workers,
the agent): set once, before the event loop starts."""

from __future__ import annotations

import gc

# The cycle collector's first threshold (Python's default: 700 net container allocations).
# Measured on the gateway: a request's objects live across several gen-0 collections at 700
# under load, are promoted, and trigger full collections every 1-2 s (20 ms each, walking every
# cache entry made since start; 40-70 ms while deferred encodes still left cycles). At 10,000
# they are freed by reference counting before a collection sees them: warm 8 KB chats at c=32
# after 20,000 unique ones, 0.447-0.459 ms of CPU per request against 0.469-0.494 and p99 20-22
# ms against 20-40 (two full collections in the run against 19); memory held by gen 0 at most
# ~10,000 small objects.
GC_GEN0_THRESHOLD = 10_000


def freeze_startup_heap() -> None:
    """What exists once the process is built (modules; the gateway's tokenizers, templates,
    config and app) lives as long as the process. Left tracked, every full collection walks all
    of it (the gateway's ~165k objects: 80-120 ms of a stalled event loop on a loaded 2-core
    host, measured on the live benchmark); frozen, full collections walk only what runs create,
    and those run rarely (``GC_GEN0_THRESHOLD``). Call before start, while nothing is running
    (one gateway process, a worker, the parent of workers, or an agent)."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)
