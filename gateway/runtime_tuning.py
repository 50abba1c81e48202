"""Process-level settings of a serving gateway (docs/performance.md, "The unloaded tail").

``settle_heap`` runs once start-up has built everything (config, tokenizers, templates, the
index's arrays, the web app): it collects, then moves every surviving object to the collector's
permanent generation (``gc.freeze``). Full collections then walk only what requests created
since, not the hundreds of thousands of start-up objects that never become garbage: a full
collection of those cost milliseconds, paid by whichever request was running when it fired.
Frozen objects are still freed when their reference count drops to zero; only reference cycles
among them are never collected, and start-up builds none that it drops.
"""

from __future__ import annotations

import gc


def settle_heap() -> int:
    """Collect, then freeze the survivors; returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
