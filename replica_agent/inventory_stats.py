"""The agent inventory's counters (replica_agent/inventory.py is their one writer, with
recovery.py and inventory_groups.py; agent_metrics.py exports them; docs/architecture.md, agent)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class InventoryStats:
    stored_blocks: int = 0  # blocks of BlockStored events keyed
    removed_blocks: int = 0  # blocks of BlockRemoved events translated
    skipped_blocks: int = 0  # blocks whose parent could not be mapped
    unknown_removals: int = 0  # removals of engine hashes we never mapped
    overflow_evictions: int = 0  # mappings dropped by the max_blocks bound
    block_size_mismatches: int = 0  # stored events whose block_size differs from the replica's
    clears: int = 0
    bad_tokens: int = 0  # stored events whose token ids are not uint32 ints (skipped)
    adopted_blocks: int = 0  # skipped blocks keyed later, once their parent was learnt
    confirmed_blocks: int = 0  # keys reported from the gateway's held-prefix hints
    held_hints: int = 0  # held-prefix hints received
