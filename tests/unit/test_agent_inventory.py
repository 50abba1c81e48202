"""The agent's inventory: re-keying, refcounts, media, the bounded hash map, degraded state."""

from __future__ import annotations

from replica_agent.engine_events import AllBlocksCleared, BlockRemoved, BlockStored
from replica_agent.inventory import AgentInventory
from router_policies.block_keys import block_keys


class RecordingSink:
    def __init__(self) -> None:
        self.ops: list[tuple[str, list[int], str]] = []
        self.view: dict[int, str] = {}

    def stored(self, keys: list[int], parent: int | None, medium: str) -> None:
        self.ops.append(("stored", keys, medium))
        for k in keys:
            self.view.setdefault(k, medium)

    def removed(self, keys: list[int], medium: str) -> None:
        self.ops.append(("removed", keys, medium))
        for k in keys:
            self.view.pop(k, None)

    def cleared(self) -> None:
        self.ops.append(("cleared", [], ""))
        self.view.clear()


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], bs: int = 2, medium: str = "GPU"
) -> BlockStored:
    return BlockStored(list(hashes), parent, tokens, bs, medium, None, None)


def test_rekey_chain_and_removal() -> None:
    sink = RecordingSink()
    inv = AgentInventory("m", 2, max_blocks=100, sink=sink)
    inv.apply([stored([10, 11], None, [1, 2, 3, 4]), stored([12], 11, [5, 6])])
    keys = block_keys([1, 2, 3, 4, 5, 6], 2, "m")
    assert sorted(inv.keys()) == sorted(keys)
    inv.apply([BlockRemoved([11], "GPU")])
    assert sorted(inv.keys()) == sorted([keys[0], keys[2]])
    assert sink.view == inv.snapshot()


def test_duplicate_store_is_idempotent_and_silent() -> None:
    sink = RecordingSink()
    inv = AgentInventory("m", 2, max_blocks=100, sink=sink)
    ev = stored([10], None, [1, 2])
    inv.apply([ev, ev])
    assert len(inv) == 1
    assert [op[0] for op in sink.ops] == ["stored"]
    inv.apply([BlockRemoved([10], "GPU")])
    assert len(inv) == 0


def test_unmapped_parent_is_skipped_and_counted() -> None:
    inv = AgentInventory("m", 2, max_blocks=100)
    inv.apply([stored([20, 21], 999, [1, 2, 3, 4])])
    assert len(inv) == 0
    assert inv.stats.skipped_blocks == 2
    assert inv.degraded  # events were missed: the inventory is incomplete
    inv.apply([BlockRemoved([20, 777], "GPU")])
    assert inv.stats.unknown_removals == 2


def test_two_engine_blocks_sharing_a_key_are_refcounted() -> None:
    inv = AgentInventory("m", 2, max_blocks=100)
    inv.apply([stored([1], None, [1, 2]), stored([2], None, [1, 2])])  # e.g. two KV-cache groups
    assert len(inv) == 1
    inv.apply([BlockRemoved([1], "GPU")])
    assert len(inv) == 1
    inv.apply([BlockRemoved([2], "GPU")])
    assert len(inv) == 0


def test_media_are_removed_independently() -> None:
    inv = AgentInventory("m", 2, max_blocks=100)
    inv.apply([stored([1], None, [1, 2]), stored([1], None, [1, 2], medium="CPU")])
    assert len(inv) == 1
    inv.apply([BlockRemoved([1], "GPU")])
    assert inv.snapshot() == {block_keys([1, 2], 2, "m")[0]: "CPU"}
    inv.apply([BlockRemoved([1], "CPU")])
    assert len(inv) == 0


def test_bound_drops_oldest_mappings_and_reports_them() -> None:
    sink = RecordingSink()
    inv = AgentInventory("m", 1, max_blocks=5, sink=sink)
    for i in range(12):
        inv.apply([stored([100 + i], None, [i], bs=1)])
        assert len(inv._map) <= 5
    assert len(inv) == 5
    assert inv.stats.overflow_evictions == 7
    assert sorted(inv.keys()) == sorted(block_keys([i], 1, "m")[0] for i in range(7, 12))
    assert sink.view == inv.snapshot()


def test_block_size_mismatch_is_skipped() -> None:
    inv = AgentInventory("m", 4, max_blocks=10)
    inv.apply([stored([1], None, [1, 2], bs=2)])
    assert len(inv) == 0 and inv.stats.block_size_mismatches == 1


def test_block_size_learned_from_first_event() -> None:
    inv = AgentInventory("m", None, max_blocks=10)
    inv.apply([stored([1], None, [1, 2, 3], bs=3)])
    assert inv.block_size == 3 and len(inv) == 1


def test_degraded_until_capacity_evicted_without_skips() -> None:
    inv = AgentInventory("m", 1, max_blocks=100)
    inv.capacity_blocks = 3
    inv.mark_degraded("test")
    inv.apply([stored([1, 2, 3, 4], None, [1, 2, 3, 4], bs=1)])
    inv.apply([BlockRemoved([1, 2], "GPU")])
    assert inv.degraded
    inv.apply([stored([9], 12345, [9], bs=1)])  # parent unknown: the rebuild count restarts
    inv.apply([BlockRemoved([3], "GPU")])
    assert inv.degraded
    inv.apply([stored([5, 6], None, [5, 6], bs=1), BlockRemoved([4, 5], "GPU"), BlockRemoved([6], "GPU")])
    assert not inv.degraded


def test_all_blocks_cleared_empties_and_completes() -> None:
    sink = RecordingSink()
    inv = AgentInventory("m", 1, max_blocks=100, sink=sink)
    inv.apply([stored([1, 2], None, [1, 2], bs=1)])
    inv.mark_degraded("test")
    inv.apply([AllBlocksCleared()])
    assert len(inv) == 0 and not inv.degraded and sink.view == {}


def test_bad_token_ids_are_skipped_not_fatal() -> None:
    inv = AgentInventory("m", 2, max_blocks=10)
    inv.apply([stored([1], None, [-1, 2]), stored([2], None, [2**32, 1]), stored([3], None, ["a", "b"])])  # type: ignore[list-item]
    assert len(inv) == 0 and inv.stats.bad_tokens == 3
    inv.apply([stored([4], None, [1, 2])])
    assert len(inv) == 1


def test_keys_at_a_multiple_of_the_engine_block_size() -> None:
    """Gateway blocks of 4 tokens over engine blocks of 2: the same keys as the gateway computes."""
    sink = RecordingSink()
    inv = AgentInventory("m", 2, max_blocks=100, sink=sink, key_block_size=4)
    assert inv.reported_block_size == 4
    inv.apply([stored([1, 2, 3], None, [1, 2, 3, 4, 5, 6])])  # 1.5 key blocks
    assert inv.keys() == block_keys([1, 2, 3, 4], 4, "m")
    inv.apply([stored([4], 3, [7, 8]), stored([5], 3, [9, 9])])  # two children of the partial block
    full_a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, "m")
    full_b = block_keys([1, 2, 3, 4, 5, 6, 9, 9], 4, "m")
    assert sorted(inv.keys()) == sorted({*full_a, *full_b})
    assert sink.view == inv.snapshot()
    inv.apply([BlockRemoved([4], "GPU")])  # the block completing one key block
    assert sorted(inv.keys()) == sorted({*full_a[:1], *full_b})
    inv.apply([BlockRemoved([3], "GPU")])  # a block inside a key block holds no key
    assert inv.stats.unknown_removals == 0
    assert sorted(inv.keys()) == sorted({*full_b})
    inv.apply([AllBlocksCleared()])
    assert len(inv) == 0 and inv._partial == {}


def test_key_block_size_not_a_multiple_is_refused() -> None:
    inv = AgentInventory("m", 3, max_blocks=10, key_block_size=4)
    inv.apply([stored([1], None, [1, 2, 3], bs=3)])
    assert len(inv) == 0 and inv.stats.block_size_mismatches == 1


def test_namespace_cache_is_bounded() -> None:
    inv = AgentInventory("m", 2, max_blocks=1000, max_namespaces=3)
    for i in range(10):
        inv.apply([BlockStored([i], None, [1, 2], 2, "GPU", None, f"salt-{i}")])
        assert len(inv._roots) <= 3
    assert sorted(inv.keys()) == sorted(
        block_keys([1, 2], 2, "m", cache_salt=f"salt-{i}")[0] for i in range(10)
    )
