"""The agent's inventory: re-keying, refcounts, media, the bounded hash map, degraded state."""

from __future__ import annotations

from replica_agent.engine_events import AllBlocksCleared, BlockRemoved, BlockStored
from replica_agent.inventory import AgentInventory
from router_policies.block_keys import block_keys


class RecordingSink:
    def __init__(self) -> None:
        self.ops: list[tuple[str, list[int], str]] = []
        self.view: dict[int, str] = {}

    def stored(self, keys: list[int], _parent: int | None, medium: str) -> None:
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


def grouped(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    group: int,
    window: int | None = None,
    bs: int = 2,
) -> BlockStored:
    """A BlockStored as vLLM 0.32 publishes it for KV-cache group ``group``: a sliding-window
    group (``window`` tokens) lists only the blocks it cached, the last ones of ``tokens``."""
    kind = "full_attention" if window is None else "sliding_window"
    return BlockStored(list(hashes), parent, tokens, bs, "GPU", None, None, group, kind, window)


def removed(hashes: list[int], group: int) -> BlockRemoved:
    return BlockRemoved(list(hashes), "GPU", group)


def test_two_engine_blocks_sharing_a_key_are_refcounted() -> None:
    """vLLM stores one block hash once per KV-cache group (same hash, another group_idx). A
    removal in one group leaves the other group's block mapped; the key is reusable only while
    every group holds it (vLLM's lookup asks each group: BlockPool.get_cached_block)."""
    sink = RecordingSink()
    inv = AgentInventory("m", 2, max_blocks=100, sink=sink)
    inv.apply([grouped([1], None, [1, 2], group=0), grouped([1], None, [1, 2], group=1)])
    key = block_keys([1, 2], 2, "m")[0]
    assert inv.keys() == [key] and inv.hybrid
    inv.apply([removed([1], group=0)])
    assert len(inv) == 0  # group 0 lost it: no prefix hit
    assert inv.stats.unknown_removals == 0
    inv.apply([grouped([1], None, [1, 2], group=0)])
    assert inv.keys() == [key]  # group 1's block was kept all along
    inv.apply([removed([1], group=1)])
    assert len(inv) == 0 and inv.stats.unknown_removals == 0
    inv.apply([removed([1], group=1)])
    assert inv.stats.unknown_removals == 1  # already gone from group 1
    assert sink.view == inv.snapshot()


def test_sliding_window_group_reports_what_the_window_needs() -> None:
    """Gemma-3 shape: group 0 sliding window of 4 tokens (2 blocks of 2), group 1 full attention.
    The sliding-window event lists only the hashes it cached (the last two blocks) while its
    token_ids span the whole range, as vLLM publishes it."""
    sink = RecordingSink()
    inv = AgentInventory("m", 2, max_blocks=100, sink=sink)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    k = block_keys(tokens, 2, "m")
    inv.apply(
        [
            grouped([13, 14], None, tokens, group=0, window=4),
            grouped([10, 11, 12, 13, 14], None, tokens, group=1),
        ]
    )
    # a hit ending at block j needs blocks j-1 and j in the window group: only block 4 qualifies
    assert inv.keys() == [k[4]]
    # the window group's removal of block 3 takes the hit away; the full group keeps its blocks
    inv.apply([removed([13], group=0)])
    assert len(inv) == 0
    # the next request recomputes block 3 in the window group (vLLM stores it again): hit back
    inv.apply([grouped([13], 12, tokens[6:8], group=0, window=4)])
    assert inv.keys() == [k[4]]
    # a decode block completes block 5: its window (blocks 4, 5) is held by both groups
    inv.apply([grouped([15], 14, [11, 12], group=0, window=4), grouped([15], 14, [11, 12], group=1)])
    k5 = block_keys([*tokens, 11, 12], 2, "m")[5]
    assert set(inv.keys()) == {k[4], k5}
    # the full group evicting block 4 ends both hits that need it
    inv.apply([removed([14], group=1)])
    assert inv.keys() == [k5] or set(inv.keys()) == {k5}
    assert inv.stats.unknown_removals == 0 and inv.stats.skipped_blocks == 0
    assert sink.view == inv.snapshot()


def test_short_prefix_needs_all_its_blocks_in_the_window_group() -> None:
    inv = AgentInventory("m", 2, max_blocks=100)
    tokens = [1, 2, 3, 4]
    k = block_keys(tokens, 2, "m")
    inv.apply([grouped([10, 11], None, tokens, group=0, window=6), grouped([10, 11], None, tokens, group=1)])
    assert set(inv.keys()) == set(k)  # both prefixes are shorter than the 3-block window
    inv.apply([removed([10], group=0)])
    assert len(inv) == 0


def test_groups_bound_and_clear() -> None:
    sink = RecordingSink()
    inv = AgentInventory("m", 1, max_blocks=6, sink=sink)
    for i in range(10):
        inv.apply(
            [
                grouped([100 + i], None, [i], group=0, window=1, bs=1),
                grouped([100 + i], None, [i], group=1, bs=1),
            ]
        )
        groups = inv._groups
        assert groups is not None
        assert len(groups._res) <= 6 and len(groups._up) <= 12 and len(groups.key_of) <= 12
    assert inv.stats.overflow_evictions == 14
    assert len(inv) == 3 and sink.view == inv.snapshot()
    inv.apply([AllBlocksCleared()])
    assert len(inv) == 0 and sink.view == {}


def test_plain_state_carries_over_when_a_second_group_appears() -> None:
    """Full attention in group 0 first (as gpt-oss orders its groups), then a window group."""
    inv = AgentInventory("m", 2, max_blocks=100)
    tokens = [1, 2, 3, 4, 5, 6]
    k = block_keys(tokens, 2, "m")
    inv.apply([grouped([10, 11, 12], None, tokens, group=0)])
    assert not inv.hybrid and set(inv.keys()) == set(k)
    inv.apply([grouped([11, 12], None, tokens, group=1, window=4)])
    assert inv.hybrid and inv.keys() == [k[2]]
    inv.apply([removed([12], group=0)])
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


def test_window_blocks_kept_at_a_junction_are_placed_by_hash() -> None:
    """vLLM keeps the window ending at a shared-prefix junction as well as the range's tail: the
    window group lists blocks 1, 2, 4, 5 of six, before the full group's store of the same step.
    Their positions come from the full group's hashes (the same hash per position)."""
    inv = AgentInventory("m", 2, max_blocks=100)
    tokens = list(range(1, 13))
    k = block_keys(tokens, 2, "m")
    inv.apply(
        [
            grouped([11, 12, 14, 15], None, tokens, group=0, window=4),
            grouped([10, 11, 12, 13, 14, 15], None, tokens, group=1),
        ]
    )
    assert set(inv.keys()) == {k[2], k[5]}  # placed as the last four blocks: {k[3], k[4], k[5]}
    inv.apply([removed([12], group=0)])
    assert inv.keys() == [k[5]]
