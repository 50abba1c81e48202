"""The agent's outbox: bounded, dropped while no stream is open, a snapshot due past its bound."""

from __future__ import annotations

from replica_agent.outbox import Outbox


def test_dropped_while_closed() -> None:
    box = Outbox(max_events=10)
    box.stored([1, 2], None, "GPU")
    assert box.take() == [] and not box.wake.is_set()
    box.reopen()
    box.stored([1, 2], 7, "GPU")
    box.removed([1], "CPU")
    box.cleared()
    events = box.take()
    assert [e.WhichOneof("kind") for e in events] == ["stored", "removed", "cleared"]
    assert list(events[0].stored.keys) == [1, 2] and events[0].stored.parent_key == 7
    assert events[0].stored.medium == "" and events[1].removed.medium == "CPU"
    assert box.wake.is_set()


def test_bound_turns_into_a_snapshot() -> None:
    box = Outbox(max_events=5)
    box.reopen()
    for i in range(6):
        box.stored([i], None, "GPU")
    assert box.need_snapshot and box.events == [] and box.overflows == 1
    box.stored([99], None, "GPU")  # nothing queues until the snapshot is taken
    assert box.events == []
    box.reopen()
    box.stored([100], None, "GPU")
    assert len(box.take()) == 1 and not box.need_snapshot
