"""Recovery without replay (replica_agent/recovery.py, orphans.py): blocks whose parent the agent
never saw are kept, and adopted once a held-prefix hint names their parent's key; the confirmed
ancestors follow their anchors out; removals, ambiguity, pending hints and the byte bound."""

from __future__ import annotations

import pytest

from replica_agent.engine_events import AllBlocksCleared, BlockRemoved
from replica_agent.inventory import AgentInventory
from replica_agent.orphans import OrphanStores
from router_policies.block_keys import block_keys
from tests.unit.test_agent_inventory import RecordingSink, stored

B = 2
SYSTEM = [1, 2, 3, 4, 5, 6]  # three blocks the engine cached before the agent started (hashes 1-3)
TAIL = [7, 8, 9, 10]  # two new blocks (hashes 11, 12) stored with parent 3


def fresh() -> tuple[AgentInventory, RecordingSink]:
    sink = RecordingSink()
    return AgentInventory("m", B, max_blocks=1000, sink=sink), sink


def test_orphans_adopted_from_a_hint_and_ancestors_confirmed() -> None:
    inv, sink = fresh()
    inv.apply([stored([11, 12], 3, TAIL)])
    assert len(inv) == 0 and inv.stats.skipped_blocks == 2 and len(inv.orphans) == 1
    keys = block_keys(SYSTEM + TAIL, B, "m")
    inv.held_prefix(keys[:3], TAIL[:B])  # cached_tokens = 6: the engine holds keys[:3]
    assert sorted(inv.keys()) == sorted(keys)
    assert sink.view == inv.snapshot()
    assert inv.stats.adopted_blocks == 2 and inv.stats.confirmed_blocks == 3 and len(inv.orphans) == 0
    # the learnt parent is an ordinary mapping: new children of it are keyed at once
    inv.apply([stored([13], 3, [11, 12])])
    assert block_keys([*SYSTEM, 11, 12], B, "m")[-1] in inv.snapshot()
    # leaf-first eviction: the anchor (hash 3) going releases its hashless ancestors
    inv.apply([BlockRemoved([13, 12, 11], "GPU")])
    assert sorted(inv.keys()) == sorted(keys[:3])
    inv.apply([BlockRemoved([3], "GPU")])
    assert inv.keys() == [] and sink.view == {}
    inv.apply([BlockRemoved([2, 1], "GPU")])  # never learnt
    assert inv.stats.unknown_removals == 2


def test_a_hint_before_the_store_waits_for_it() -> None:
    inv, sink = fresh()
    keys = block_keys(SYSTEM + TAIL, B, "m")
    inv.held_prefix(keys[:3], TAIL[:B])
    assert len(inv) == 0
    inv.apply([stored([11, 12], 3, TAIL)])
    assert sorted(inv.keys()) == sorted(keys) and sink.view == inv.snapshot()


def test_children_of_orphans_adopted_and_removed_orphans_not() -> None:
    inv, sink = fresh()
    # the request's blocks, then a decode block below them, then the last one evicted
    inv.apply([stored([11, 12], 3, TAIL), stored([14, 15], 12, [20, 21, 22, 23])])
    inv.apply([BlockRemoved([15], "GPU")])
    assert inv.stats.unknown_removals == 1  # never keyed, so counted (and the orphan truncated)
    keys = block_keys(SYSTEM + TAIL + [20, 21, 22, 23], B, "m")
    inv.held_prefix(keys[:3], TAIL[:B])
    assert sorted(inv.keys()) == sorted(keys[:-1]) and sink.view == inv.snapshot()
    # an orphan whose first block went is gone entirely
    inv.apply([stored([31], 30, [40, 41]), BlockRemoved([31], "GPU")])
    inv.held_prefix(block_keys([50, 51, 40, 41], B, "m")[:1], [40, 41])
    assert sorted(inv.keys()) == sorted(keys[:-1])


def test_ambiguous_hint_is_not_used() -> None:
    inv, _ = fresh()
    # the same first block below two unknown parents: the hint cannot say which is its parent
    inv.apply([stored([11], 3, [7, 8]), stored([21], 9, [7, 8])])
    inv.held_prefix(block_keys([*SYSTEM, 7, 8], B, "m")[:3], [7, 8])
    assert len(inv) == 0 and len(inv.orphans) == 2


def test_orphans_adopted_when_the_engines_events_key_their_parent() -> None:
    inv, sink = fresh()
    inv.apply([stored([11], 3, [7, 8]), stored([12], 11, [9, 10])])
    inv.apply([stored([3], None, [70, 71])])  # hash 3 is keyed after all (its store came late)
    assert sorted(inv.keys()) == sorted(block_keys([70, 71, 7, 8, 9, 10], B, "m"))
    assert len(inv.orphans) == 0 and inv.stats.adopted_blocks == 2 and sink.view == inv.snapshot()


def test_a_hint_contradicting_a_known_mapping_is_ignored() -> None:
    inv, _ = fresh()
    inv.apply([stored([3], None, [70, 71])])
    before = inv.snapshot()
    inv._learn(3, [123, 456])  # a hint naming another key for hash 3
    assert inv.snapshot() == before and inv.hashless_keys == 0


def test_hint_of_a_request_keyed_normally_adopts_nothing() -> None:
    inv, _ = fresh()
    # the same first block below a known prefix (keyed) and below an unknown one (an orphan)
    inv.apply([stored([41, 42], None, [90, 91, 92, 93]), stored([43], 42, [7, 8]), stored([11], 3, [7, 8])])
    known = block_keys([90, 91, 92, 93, 7, 8], B, "m")
    inv.held_prefix(known[:2], [7, 8])  # the hint of the keyed request: not about the orphan
    assert sorted(inv.keys()) == sorted(known) and len(inv.orphans) == 1


def test_engine_removal_of_a_confirmed_key_drops_it() -> None:
    inv, _ = fresh()
    keys = block_keys(SYSTEM + TAIL, B, "m")
    inv.apply([stored([11, 12], 3, TAIL)])
    inv.held_prefix(keys[:3], TAIL[:B])
    # a later hint (cached 2 blocks) learns hash 2 for keys[1], hashless until then
    inv.apply([stored([16], 2, [60, 61])])
    inv.held_prefix(keys[:2], [60, 61])
    assert keys[1] in inv.snapshot()
    inv.apply([BlockRemoved([2], "GPU")])  # the engine evicted it: no hint keeps it
    assert keys[1] not in inv.snapshot()


def test_clear_forgets_orphans_and_hints() -> None:
    inv, _ = fresh()
    inv.apply([stored([11, 12], 3, TAIL)])
    inv.held_prefix([5], [1, 1])
    inv.apply([AllBlocksCleared()])
    assert len(inv.orphans) == 0
    inv.held_prefix(block_keys(SYSTEM + TAIL, B, "m")[:3], TAIL[:B])
    assert len(inv) == 0


def test_orphan_bytes_are_bounded() -> None:
    orphans = OrphanStores(max_bytes=4000)
    for i in range(100):
        orphans.add(stored([1000 + i, 2000 + i], 5000 + i, [i, i, i, i]), 5000 + i)
        assert orphans.bytes <= 4000
    assert 0 < len(orphans) < 100 and orphans.dropped == 100 - len(orphans)
    assert orphans.parents_starting((0, 0)) == set()  # the oldest went first
    assert orphans.parents_starting((99, 99)) == {5099}
    with pytest.raises(ValueError):
        OrphanStores(0)
