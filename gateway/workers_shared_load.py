"""The workers' in-flight load in one shared table (``kvgate serve --workers N``;
docs/architecture.md, "Workers"): each worker writes its own row of every replica's figures when
its flights change, and every decision reads the other workers' rows.

Why beside the parent's relay (gateway/local_hub_load.py). A burst's requests reach a worker's
event loop together, and their handlers run to their upstream writes one after another in the
same turn of the loop. No frame from the parent is read during that turn. So each worker decided
its share of a burst without the other workers' share: the relayed figures were zero at 300 of
300 dispatches of a Mooncake replay, even with 1 ms reports (docs/performance.md, "Why two
workers place a burst worse"). The relay still carries what this table does not: the blocks
that several workers' flights hold (``RemoteLoad.overlap_tokens``).

Layout: a file in the workers' socket directory, mapped by every process, little-endian.
    header  5 x uint64: MAGIC, workers, slots, overflow (1 once a replica found no slot),
            claims (slots claimed so far: a replica found in none is looked for again after one)
    keys    slots x uint64: a slot's replica, as ``replica_key`` of its id (0: free)
    rows    workers x slots x FIELDS float64: requests, tokens, pending prefill tokens, their
            attention pairs, shared cached tokens, the oldest pending start (CLOCK_MONOTONIC,
            one clock for the host; 0: none)

Locking: one exclusive ``flock`` on the file, for decisions and for claiming slots. A worker's
decision takes it at its snapshot (``begin_decision``) and lets it go once the decided attempt's
load is published (``WorkerFleet.flights_changed`` with its ``Dispatch``, which ends the turn),
before the request is written (gateway/proxy.py, ``_attempt``). Nothing awaits between
``Router.decide`` and that publication: one synchronous stretch with no I/O in it, 0.10-0.18
ms at the median at c=32 (0.27-0.46 while it also spanned the write, the commit and the flight's
accounting). So the decisions that hold it are serialized, and each reads the load of every
attempt decided before it (the flight's own figures replace the decision's once it opens). Before
deciding, a worker waits for it (``decision_turn``, ``server.workers_decide_in_turn``): its loop
runs meanwhile, trying the lock once a turn, and once ``TURN_WAIT_S`` has passed it decides
without it (the holder may be descheduled on a busy host). A wait lasts at least a turn of the
loop, so under load it outlasts ``TURN_WAIT_S`` (docs/performance.md, "How long a decision waits
for its turn with two workers": 2-6 ms at the median at c=32, for a fifth of the decisions).
``begin_decision`` never waits. A decision that sends nothing (no replica, ``/admin/explain``,
an error) lets go at the end of its turn of the loop. A process that dies
holding the lock loses it (the kernel releases it).

Measured (docs/performance.md, "Why two workers place a burst worse"), the Mooncake slice with
two workers: the TTFT audit error 0.30-0.34 without the table, 0.28 with it and no wait,
0.20-0.22 with the wait (one process: 0.19).

Invariants
* A worker writes only its own rows (``publish``), without the lock: a reader may see a row
  mid-update (some fields of the last publication, some of the one before). A worker's rows are
  zeroed when it starts and by the parent when it exits (``clear``): its flights ended with it.
* A slot is claimed (its key written) under the lock. A claimed slot is taken for another replica
  only when every worker's row for it is zero (no flight there anywhere). Every access checks
  that a remembered slot still has its replica's key, else it looks the replica up again.
* Bounded: the file is ``table_bytes(workers, slots)``, fixed at creation. A replica that finds
  no slot (more than ``slots`` replicas with flights at once) is read from the relay instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import math
import mmap
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from gateway.local_hub_load import flight_figures
from gateway.replica_load import RemoteLoad
from router_policies.flights import Dispatch, FlightCounters

LOAD_TABLE = "load"  # the table's file name in the workers' socket directory
MAGIC = 0x6B76676174654C31  # "kvgateL1"
SLOTS = 4096  # replicas with flights at once (as TtftModel's max_replicas)
FIELDS = 6
TURN_WAIT_S = 0.002  # after this, a decision stops trying for another worker's turn (~0.15 ms each)
_HEADER = 5
_OVERFLOW = 3
_CLAIMS = 4
_OLDEST = 5

Figures = tuple[float, float, float, float, float, float]


def table_bytes(workers: int, slots: int = SLOTS) -> int:
    return 8 * (_HEADER + slots + workers * slots * FIELDS)


def replica_key(replica: str) -> int:
    """A replica id's 64-bit key (never 0, the free slot's)."""
    return int.from_bytes(hashlib.blake2b(replica.encode(), digest_size=8).digest(), "little") or 1


def create_table(path: Path, workers: int, slots: int = SLOTS) -> None:
    """The parent, before it starts the workers: an empty table (a sparse file of zeros)."""
    with open(path, "wb") as f:
        f.truncate(table_bytes(workers, slots))
        f.write(np.array([MAGIC, workers, slots, 0, 0], dtype="<u8").tobytes())


def own_figures(c: FlightCounters) -> Figures:
    """``flight_figures`` as the table holds them (floats; no pending start: 0)."""
    requests, tokens, prefill, pairs, shared, oldest = flight_figures(c)
    return (float(requests), float(tokens), float(prefill), pairs, float(shared), oldest or 0.0)


def with_decided(f: Figures, d: Dispatch, now: float) -> Figures:
    """``f`` (``own_figures``) with a decided attempt's load (``Dispatch.load``: as its flight will
    count it) and, if none was pending, ``now`` as the oldest start. Its cached blocks count as
    held by it alone: until its flight opens (~0.2 ms later) the shared tokens are short by those
    the flights there already hold, so the KV the replica's flights pin reads a little high."""
    tokens, prefill, pairs = d.load()
    return (f[0] + 1, f[1] + tokens, f[2] + prefill, f[3] + pairs, f[4], f[_OLDEST] or now)


def with_figures(relayed: RemoteLoad, f: Figures) -> RemoteLoad:
    """The relayed load with the table's figures in place of the relay's (fresher); the relay's
    overlap, the blocks several workers' flights hold, stays (the table does not know it)."""
    overlap = relayed.overlap_tokens
    oldest = f[_OLDEST] or None
    return RemoteLoad(
        int(f[0]), int(f[1]), int(f[2]), relayed.engine, f[3], int(f[4]) + overlap, oldest, overlap
    )


class SharedLoad:
    """One process's mapping of the table; ``worker``: its row (None: the parent, which only
    clears rows)."""

    def __init__(self, path: Path, worker: int | None) -> None:
        self._fd = os.open(path, os.O_RDWR)
        try:
            header = np.frombuffer(os.pread(self._fd, 8 * _HEADER, 0), dtype="<u8")
            if len(header) < _HEADER:
                raise OSError(f"{path}: not a workers' load table")
            magic, workers, slots = header[:3]
            if magic != MAGIC or os.fstat(self._fd).st_size != table_bytes(int(workers), int(slots)):
                raise OSError(f"{path}: not a workers' load table")
            if worker is not None and not 0 <= worker < workers:
                raise OSError(f"{path}: no row for worker {worker} of {workers}")
            self._map = mmap.mmap(self._fd, table_bytes(int(workers), int(slots)))
        except BaseException:
            os.close(self._fd)
            raise
        self.workers, self.slots, self.worker = int(workers), int(slots), worker
        keys_at, rows_at = 8 * _HEADER, 8 * (_HEADER + self.slots)
        # numpy views for the rare scans (a slot to claim), memoryviews for the per-request reads
        # and writes (a few cells: numpy's per-call cost would be most of it)
        self._header = np.ndarray((_HEADER,), dtype="<u8", buffer=self._map)
        self._keys = np.ndarray((self.slots,), dtype="<u8", buffer=self._map, offset=keys_at)
        self._rows = np.ndarray(
            (self.workers, self.slots, FIELDS), dtype="<f8", buffer=self._map, offset=rows_at
        )
        self._key_cells = memoryview(self._map)[keys_at:rows_at].cast("Q")
        self._cells = memoryview(self._map)[rows_at:].cast("d")
        self._others = [w for w in range(self.workers) if w != worker]
        self._slot_of: dict[str, tuple[int, int]] = {}  # replica -> (slot, key), checked at each use
        # replica -> the claims count when it was found in no slot: not looked for again (a scan of
        # every key) until a slot is claimed; at most ``slots`` entries, as ``_slot_of``
        self._absent: dict[str, int] = {}
        self._held = False
        if worker is not None:
            self.clear(worker)

    # ------------------------------------------------------------------ the lock
    def begin_decision(self) -> bool:
        """Take the lock for a decision if no other worker holds it (whether this process holds
        it now): until ``end_decision`` (its decided load published), at the latest until the end of
        this turn of the running loop (a decision that sends nothing). Never waits."""
        if self._held:
            return True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._held = True
        with contextlib.suppress(RuntimeError):  # no running loop: end_decision releases it
            asyncio.get_running_loop().call_soon(self.end_decision)
        return True

    async def decision_turn(self) -> None:
        """Wait for the lock, letting the loop run meanwhile and trying it once a turn of the loop,
        until ``TURN_WAIT_S`` has passed (then the decision goes on without it: its holder may be
        descheduled on a busy host); the last turn may end well past it."""
        if self.begin_decision():
            return
        deadline = time.monotonic() + TURN_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0)  # the other worker's decision (~0.15 ms); the loop runs meanwhile
            if self.begin_decision():
                return

    def end_decision(self) -> None:
        if self._held:
            self._held = False
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock to claim a slot: a decision's if it holds it, else taken for the block."""
        if self._held:
            yield
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------------ slots
    def _slot(self, replica: str, claim: bool) -> int | None:
        known = self._slot_of.get(replica)
        if known is not None and self._key_cells[known[0]] == known[1]:
            return known[0]
        key = known[1] if known is not None else replica_key(replica)
        if not claim:
            claims = int(self._header[_CLAIMS])
            if self._absent.get(replica) == claims:
                return None
            found = np.flatnonzero(self._keys == key)
            if len(found):
                return self._remember(replica, int(found[0]), key)
            if len(self._absent) >= self.slots:
                self._absent.clear()
            self._absent[replica] = claims
            return None
        with self._locked():
            found = np.flatnonzero(self._keys == key)
            if len(found):
                return self._remember(replica, int(found[0]), key)
            free = np.flatnonzero(self._keys == 0)
            if not len(free):  # a slot no flight uses anywhere
                free = np.flatnonzero(~self._rows.any(axis=(0, 2)))
            if not len(free):
                self._header[_OVERFLOW] = 1
                return None
            self._keys[free[0]] = key
            self._header[_CLAIMS] += 1
            return self._remember(replica, int(free[0]), key)

    def _remember(self, replica: str, slot: int, key: int) -> int:
        if len(self._slot_of) >= self.slots:
            self._slot_of.clear()
        self._slot_of[replica] = (slot, key)
        return slot

    # ------------------------------------------------------------------ rows
    def publish(self, replica: str, figures: Figures) -> None:
        """This worker's figures for ``replica`` (``own_figures`` of its flight counters)."""
        assert self.worker is not None
        slot = self._slot(replica, claim=any(figures))
        if slot is not None:
            base = (self.worker * self.slots + slot) * FIELDS
            cells = self._cells
            for i in range(FIELDS):
                cells[base + i] = figures[i]

    def others(self, replicas: Sequence[str]) -> list[Figures | None]:
        """Per replica, the other workers' figures: their sums, and the oldest pending start
        among them (0: none); None for a replica the table cannot say (it overflowed)."""
        out: list[Figures | None] = []
        cells, slots = self._cells, self.slots
        for replica in replicas:
            slot = self._slot(replica, claim=False)
            if slot is None:
                out.append(None if self._header[_OVERFLOW] else (0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
                continue
            requests = tokens = prefill = pairs = shared = 0.0
            oldest = math.inf
            for w in self._others:
                base = (w * slots + slot) * FIELDS
                requests += cells[base]
                tokens += cells[base + 1]
                prefill += cells[base + 2]
                pairs += cells[base + 3]
                shared += cells[base + 4]
                start = cells[base + _OLDEST]
                if 0.0 < start < oldest:
                    oldest = start
            out.append((requests, tokens, prefill, pairs, shared, 0.0 if oldest == math.inf else oldest))
        return out

    def clear(self, worker: int) -> None:
        """Zero ``worker``'s rows: it starts, or it exited (the parent)."""
        self._rows[worker] = 0.0

    def close(self) -> None:
        self.end_decision()
        # views of the map, which cannot close under them
        del self._header, self._keys, self._rows, self._key_cells, self._cells
        self._map.close()
        os.close(self._fd)
