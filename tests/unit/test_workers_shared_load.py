"""The workers' shared load table (gateway/workers_shared_load.py): what a worker reads of the
others is what they published, at once; its decision lock; its slots; its bound in bytes."""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

import orjson
import pytest

from gateway.config import parse_config
from gateway.local_hub_client import WorkerFleet
from gateway.local_hub_codec import decode_json
from gateway.local_hub_load import LoadReporter, LoadTable, remote_loads
from gateway.replica_identity import ReplicaIdentity
from gateway.replica_load import NO_REMOTE_LOAD, RemoteLoad, combined_queue
from gateway.replica_record import ReplicaRecord
from gateway.workers_shared_load import (
    FIELDS,
    Figures,
    SharedLoad,
    create_table,
    own_figures,
    table_bytes,
    with_figures,
)
from router_policies.flights import Dispatch, FlightCounters
from router_policies.index_types import MatchResult
from router_policies.policy import RequestFeatures
from router_policies.prefix_index import IndexConfig, PrefixIndex
from router_policies.ttft_feed import FIT_BURST, FITS_PER_S
from tests.flight_walk import BLOCK, walk

IDLE: Figures = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def _tables(tmp_path: Path, workers: int, slots: int = 64) -> list[SharedLoad]:
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "load"
    create_table(path, workers, slots)
    return [SharedLoad(path, w) for w in range(workers)]


def _record() -> ReplicaRecord:
    return ReplicaRecord(ReplicaIdentity("r", "http://r", frozenset(), static=True))


def test_each_worker_reads_the_others_flights_as_one_process_counts_them(tmp_path: Path) -> None:
    """After every change of any worker's flights, published at once, each worker's figures plus
    what it reads of the others (the table for the load, the parent's relay for the blocks two
    workers hold) equal one process's count of every flight."""
    tables = _tables(tmp_path, 3)
    workers = [_record() for _ in tables]
    reporters = [LoadReporter() for _ in tables]
    relay = LoadTable()
    whole = FlightCounters()
    for step, w, now in walk(11, workers, whole):
        tables[w].publish("r", own_figures(workers[w].flights))
        for n, (rec, reporter) in enumerate(zip(workers, reporters, strict=True)):
            relay.update(n, decode_json(orjson.dumps(reporter.report([rec]))))
        for n, (rec, table) in enumerate(zip(workers, tables, strict=True)):
            relayed = remote_loads(decode_json(orjson.dumps(relay.others(n))), lambda _r: BLOCK)
            figures = table.others(["r"])[0]
            assert figures is not None
            load = with_figures(relayed.get("r", NO_REMOTE_LOAD), figures)
            pairs, shared, age = combined_queue(rec.flights, load, now)
            assert load.requests + rec.flights.requests == whole.requests, (step, n)
            assert load.tokens + rec.flights.tokens == whole.tokens, (step, n)
            assert load.prefill + rec.flights.pending_prefill_tokens == whole.pending_prefill_tokens
            assert abs(pairs - whole.pending_prefill_pairs) < 1e-6, (step, n)
            assert shared == whole.shared_tokens, (step, n)
            assert age == whole.pending_age_ms(now), (step, n)
    for t in tables:
        t.close()


def test_a_decision_holds_the_lock_until_its_load_is_published_or_the_end_of_its_turn(tmp_path: Path) -> None:
    first, second = _tables(tmp_path, 2)
    probe = os.open(tmp_path / "load", os.O_RDWR)

    def free() -> bool:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(probe, fcntl.LOCK_UN)
        return True

    async def turns() -> None:
        first.begin_decision()
        assert not free()
        second.begin_decision()  # never waits: decides without the lock
        assert not second._held
        first.end_decision()  # its decided attempt's load is published
        assert free()
        first.begin_decision()  # a decision that sends nothing ...
        assert not free()
        await asyncio.sleep(0)  # ... lets go at the end of its turn of the loop
        assert free()

    asyncio.run(turns())
    os.close(probe)
    first.close()
    second.close()


def test_slots_are_claimed_reused_when_idle_and_checked_at_each_use(tmp_path: Path) -> None:
    a, b = _tables(tmp_path, 2, slots=2)
    busy = (1.0, 100.0, 50.0, 10.0, 0.0, 5.0)
    a.publish("x", busy)
    a.publish("y", busy)
    assert b.others(["x", "y"]) == [busy, busy]
    a.publish("z", busy)  # no free slot and none idle: the table cannot say
    assert b.others(["z"]) == [None]
    a.publish("x", IDLE)  # x idle everywhere: its slot may go to another replica
    a.publish("z", busy)
    assert b.others(["z", "y"]) == [busy, busy]
    assert b.others(["x"]) == [None]  # overflowed once: a replica without a slot is not known
    b.publish("x", busy)  # b's remembered slot for x is z's now: none free or idle, not written
    assert a.others(["x"]) == [None]
    assert b.others(["z"]) == [busy]
    a.close()
    b.close()
    # a slot b remembers, taken by another replica while idle: b looks its replica up again
    c, d = _tables(tmp_path / "again", 2, slots=2)
    c.publish("x", busy)
    assert d.others(["x"]) == [busy]  # d remembers x's slot
    for replica, figures in (("x", IDLE), ("y", busy), ("w", busy), ("y", IDLE), ("v", busy)):
        c.publish(replica, figures)  # w takes x's idle slot, then v takes y's
    assert d.others(["x"]) == [IDLE]  # not w's figures, in x's old slot
    c.close()
    d.close()


def test_a_replica_in_no_slot_is_looked_for_again_once_a_slot_is_claimed(tmp_path: Path) -> None:
    a, b = _tables(tmp_path, 2)
    busy = (1.0, 64.0, 32.0, 2.0, 0.0, 3.0)
    assert b.others(["q"]) == [IDLE]  # no worker has flights there: remembered as absent
    a.publish("q", busy)  # a claims a slot for it
    assert b.others(["q"]) == [busy]
    a.close()
    b.close()


def test_a_workers_rows_are_zeroed_when_it_starts_or_exits(tmp_path: Path) -> None:
    a, b = _tables(tmp_path, 2)
    a.publish("r", (3.0, 30.0, 20.0, 5.0, 0.0, 7.0))
    parent = SharedLoad(tmp_path / "load", None)
    parent.clear(0)  # worker 0 exited
    assert b.others(["r"]) == [IDLE]
    a.publish("r", (3.0, 30.0, 20.0, 5.0, 0.0, 7.0))
    again = SharedLoad(tmp_path / "load", 0)  # worker 0 started again
    assert b.others(["r"]) == [IDLE]
    for t in (a, b, parent, again):
        t.close()


def test_the_table_holds_its_bound_in_bytes(tmp_path: Path) -> None:
    """The file is sized at creation and never grows, however many replicas come and go."""
    tables = _tables(tmp_path, 3, slots=16)
    bound = table_bytes(3, 16)
    assert bound == 8 * (5 + 16 + 3 * 16 * FIELDS)
    for i in range(500):
        tables[i % 3].publish(f"r{i}", (1.0, 1.0, 1.0, 1.0, 0.0, 1.0))
        tables[i % 3].publish(f"r{i}", IDLE)
    assert (tmp_path / "load").stat().st_size == bound
    for t in tables:
        t.close()


def test_a_file_that_is_not_a_table_or_a_worker_beyond_it_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"\0" * 4096)
    with pytest.raises(OSError, match="not a workers' load table"):
        SharedLoad(bad, 0)
    create_table(tmp_path / "load", 2, 8)
    with pytest.raises(OSError, match="no row for worker 2"):
        SharedLoad(tmp_path / "load", 2)


class _Link:
    """What a ``WorkerFleet`` asks of its ``HubClient``: the table, and a channel to the parent."""

    def __init__(self, table: SharedLoad) -> None:
        self.shared_load = table
        self.workers = table.workers
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


REQUEST = RequestFeatures(model="m", block_keys=(), prompt_tokens=700, block_size=BLOCK)
NOTHING = MatchResult(blocks={}, scores={})  # no block of the request held anywhere


def _fleets(tmp_path: Path, slots: int = 64) -> tuple[list[_Link], list[WorkerFleet]]:
    """Two workers' fleets of one replica, r0, on one table of ``slots``."""
    cfg = parse_config(
        {
            "models": [{"name": "m", "block_size": BLOCK}],
            "replicas": [{"id": "r0", "url": "http://127.0.0.1:9", "models": ["m"]}],
            "inventory": {"allow_registration": False},
        }
    )
    create_table(tmp_path / "load", 2, slots)
    links = [_Link(SharedLoad(tmp_path / "load", w)) for w in range(2)]
    return links, [WorkerFleet(cfg, PrefixIndex(IndexConfig()), link) for link in links]  # type: ignore[arg-type]


def _seen(link: _Link, fleet: WorkerFleet) -> tuple[int, int]:
    """r0's requests and pending prefill in a decision's snapshot (one that sends nothing)."""
    state = fleet.snapshot(fleet.candidates("m"), REQUEST, NOTHING).replicas[0]
    link.shared_load.end_decision()  # as at the end of its turn of the loop
    return state.in_flight_requests, state.pending_prefill_tokens


def test_a_workers_decision_sees_the_other_workers_dispatch_before_any_relay(tmp_path: Path) -> None:
    """Worker 1's snapshot counts worker 0's flight from its dispatch to its first byte and end,
    with no frame from the parent in between (the relay is what a burst never waits for)."""
    links, fleets = _fleets(tmp_path)
    assert _seen(links[1], fleets[1]) == (0, 0)
    rec = fleets[0].get("r0")
    assert rec is not None
    state = fleets[0].snapshot(fleets[0].candidates("m"), REQUEST, NOTHING).replicas[0]
    flight = fleets[0].dispatch(rec, Dispatch.of(state, REQUEST, 0, 10))
    assert _seen(links[1], fleets[1]) == (1, 700)
    flight.first_byte()
    fleets[0].flights_changed(rec)  # as gateway/upstream.py does at the first byte
    assert _seen(links[1], fleets[1]) == (1, 0)
    flight.end()
    fleets[0].flights_changed(rec)
    assert _seen(links[1], fleets[1]) == (0, 0)
    for link in links:
        link.shared_load.close()


def test_a_decision_ends_its_turn_with_its_load_published_before_its_flight_opens(tmp_path: Path) -> None:
    """The proxy publishes a decided attempt's load (``flights_changed`` with its ``Dispatch``)
    before it writes the request: the lock is free from there, worker 1 already counts the attempt
    as its flight will, and the flight's own figures, once it opens, are the same but for the
    blocks it shares with other flights (none here)."""
    links, fleets = _fleets(tmp_path)
    rec = fleets[0].get("r0")
    assert rec is not None
    state = fleets[0].snapshot(fleets[0].candidates("m"), REQUEST, NOTHING).replicas[0]
    assert links[0].shared_load._held  # the decision's turn
    dispatch = Dispatch.of(state, REQUEST, 320, 10)
    fleets[0].flights_changed(rec, dispatch)
    assert not links[0].shared_load._held  # ended with the publication
    decided = links[1].shared_load.others(["r0"])[0]
    assert _seen(links[1], fleets[1]) == (1, 700 - 320)
    fleets[0].dispatch(rec, dispatch)
    opened = links[1].shared_load.others(["r0"])[0]
    assert decided is not None and opened is not None
    assert decided[:5] == opened[:5] == own_figures(rec.flights)[:5]
    assert decided[5] > 0 and opened[5] > 0  # a prefill pending since the decision, then the flight
    for link in links:
        link.shared_load.close()


def test_the_workers_fit_as_many_first_tokens_of_a_replica_as_one_process(tmp_path: Path) -> None:
    """Each worker's fit budget is its share of one process's: two workers each dispatching to r0
    far above the rate for 10 s leave the parent as many fits to make as one process would."""
    links, fleets = _fleets(tmp_path)
    seconds, rate = 10, 1000
    taken = sum(f.ttft.budget.take("r0", i / rate) for f in fleets for i in range(seconds * rate))
    assert FITS_PER_S * seconds <= taken <= FITS_PER_S * seconds + FIT_BURST + 2
    for link in links:
        link.shared_load.close()


def test_a_replica_the_table_cannot_say_is_routed_on_the_relay(tmp_path: Path) -> None:
    """Once the table has no slot for r0 (its one slot taken by another replica's flights), worker
    1 routes on the parent's last relay for r0, not on what the table said before."""
    links, fleets = _fleets(tmp_path, slots=1)
    table = links[0].shared_load
    fleets[1].apply_remote_load({"r0": RemoteLoad(3, 1200, 1000)})
    table.publish("r0", (2.0, 900.0, 800.0, 1.0, 0.0, 1.0))
    assert _seen(links[1], fleets[1]) == (2, 800)  # the table's, fresher than the relay
    table.publish("r0", IDLE)
    table.publish("elsewhere", (1.0, 10.0, 10.0, 1.0, 0.0, 1.0))  # takes r0's idle slot
    table.publish("r0", (2.0, 900.0, 800.0, 1.0, 0.0, 1.0))  # no slot left: overflow
    assert _seen(links[1], fleets[1]) == (3, 1000)
    for link in links:
        link.shared_load.close()
