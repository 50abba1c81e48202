"""gateway/inventory_ops.py: one decoder of agent events into ops, and ``inv.apply_ops`` giving the
same inventory on every target (the prefix index, a staged snapshot, the bound check's count)."""

from __future__ import annotations

import pytest

from gateway import inventory_ops as inv
from gateway.inventory_ops import Op
from proto.kvgate.v1 import inventory_pb2 as pb
from router_policies.prefix_index import IndexConfig, PrefixIndex

EVENTS = [
    pb.Event(stored=pb.Stored(keys=[1, 2, 3])),
    pb.Event(stored=pb.Stored(keys=[4, 5], medium="CPU")),
    pb.Event(removed=pb.Removed(keys=[2, 9])),
    pb.Event(cleared=pb.Cleared()),
    pb.Event(stored=pb.Stored(keys=[6, 7])),
    pb.Event(stored=pb.Stored(keys=[8], medium="CPU")),
    pb.Event(removed=pb.Removed(keys=[7])),
]


def test_events_decode_into_ops_with_their_medium() -> None:
    assert inv.ops_of_events(EVENTS[:4]) == [
        Op("s", [1, 2, 3], "GPU"),
        Op("s", [4, 5], "CPU"),
        Op("r", [2, 9]),
        Op("c"),
    ]
    assert inv.op_of_chunk(pb.SnapshotChunk(keys=[1, 2], medium="")) == Op("s", [1, 2], "GPU")


def test_an_event_without_a_kind_refuses_the_whole_batch() -> None:
    with pytest.raises(inv.MalformedOps):
        inv.ops_of_events([EVENTS[0], pb.Event()])


def test_index_and_staging_end_with_the_same_inventory() -> None:
    ops = inv.ops_of_events(EVENTS)
    index = PrefixIndex()
    index.add_replica("r0")
    target = inv.IndexReplica(index, "r0")
    inv.apply_ops(ops, target)
    staging = inv.Staging(snapshot_id=1, bound=100)
    inv.apply_ops(ops, staging)
    assert staging.entries == {6: "GPU", 8: "CPU"}
    assert sorted(index.precise_keys("r0")) == sorted(staging.entries)
    assert index.match([8]).scores["r0"] < index.match([6]).scores["r0"]  # 8 is in CPU memory
    assert (target.stored, target.removed, target.cleared) == (8, 2, 1)


def test_the_bound_check_refuses_at_the_step_that_crosses_the_bound() -> None:
    index = PrefixIndex(IndexConfig(max_total_blocks=100))
    index.add_replica("r0")
    index.store("r0", [1, 2, 3])
    check = inv.BoundCheck.of(index, "r0", bound=4)
    # a removal first makes room: 3 - 1 + 2 = 4 fits
    inv.apply_ops([Op("r", [1]), Op("s", [10, 11])], check)
    with pytest.raises(inv.BoundExceeded, match="bound of 4"):
        inv.apply_ops([Op("s", [12])], check)
    total = inv.BoundCheck.of(index, "r0", bound=1000)
    total.limit_total = 4
    with pytest.raises(inv.BoundExceeded, match="max_total_blocks=4"):
        inv.apply_ops([Op("s", [20, 21])], total)
    assert sorted(index.precise_keys("r0")) == [1, 2, 3]  # a check never touches the index
