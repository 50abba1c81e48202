"""The in-flight load the HTTP workers exchange through the parent (``kvgate serve --workers N``;
docs/architecture.md, "Workers"), so that every worker's fleet snapshot carries what one process
routing every request would have seen at the last reports: requests, tokens, pending prefill and
its attention pairs, the cached tokens the flights share, and the age of the oldest request
without a first byte. Not within a burst: a worker decides the requests that reach its loop
together before it reads the next relay (docs/performance.md, "Why two workers place a burst
worse").

* ``LoadReporter`` (worker): this worker's figures per replica, and the changes of the set of
  block keys its flights hold (predicted cached; ``FlightCounters.held_keys``) since its last
  report: ``{"load": {replica: [requests, tokens, prefill, pairs, shared, oldest start]},
  "held": {replica: [keys]}, "freed": {replica: [keys]}}``.
* ``LoadTable`` (parent): every worker's last figures and held keys; ``others(n)`` is what
  worker ``n`` adds to its own: the other workers' sums, the oldest start among them, and the
  blocks held by more than one worker (``overlap``); ``others_each``: that for every worker in
  one pass (the parent's relay).
* ``remote_loads`` (worker): the parent's answer as ``RemoteLoad`` per replica.

Shared tokens: one process counts ``sum over held blocks of (flights holding it - 1)`` blocks.
Over workers that is each worker's own count plus, per block, the workers holding it less one
(a block two workers' flights hold is pinned once by the engine); so the parent keeps, per
replica, how many workers hold each key, and ``overlap`` (in blocks) is exact at the time of the
last reports. A sum of the workers' own counts alone would miss every prefix two workers hold.

Invariants
* The parent's key table mirrors the workers' ``FlightCounters`` key sets: bounded, like them,
  by the flights in progress; a worker gone takes its keys and figures with it (``drop``).
* A worker reports a key as held once, then as freed once (the set difference of its key set
  between reports); a freed key the parent does not hold for it is ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gateway.replica_load import RemoteLoad
from gateway.replica_record import ReplicaRecord
from router_policies.flights import FlightCounters

# figures a worker reports per replica: requests, tokens, prefill, pairs, shared, oldest start
_SUMMED = 5


def flight_figures(c: FlightCounters) -> tuple[int, int, int, float, int, float | None]:
    """What a worker tells the others of its flights on one replica: requests, tokens, pending
    prefill, its attention pairs, shared cached tokens, the oldest pending start (None: none).
    Reported to the parent here, published in the workers' shared table too
    (gateway/workers_shared_load.py)."""
    return (
        c.requests,
        c.tokens,
        c.pending_prefill_tokens,
        c.pending_prefill_pairs,
        c.shared_tokens,
        c.oldest_pending_start(),
    )


class LoadReporter:
    """A worker's load reports (see the module docstring); one per worker, its load task's."""

    def __init__(self) -> None:
        self._sent: dict[str, set[int]] = {}  # replica -> keys last reported held
        # replica -> (its flight counters, started, requests) at the last report: the key set
        # changes only when a flight starts or ends, or when the replica is a new record (one
        # that left the fleet and came back, or was replaced, counts again from (0, 0))
        self._marks: dict[str, tuple[object, int, int]] = {}

    def report(self, records: Iterable[ReplicaRecord]) -> dict[str, Any]:
        load: dict[str, list[Any]] = {}
        held: dict[str, list[int]] = {}
        freed: dict[str, list[int]] = {}
        seen = set()
        for rec in records:
            c, rid = rec.flights, rec.id
            seen.add(rid)
            if c.requests or c.pending_prefill_tokens:
                load[rid] = list(flight_figures(c))
            mark = self._marks.get(rid)
            if mark is None or mark[0] is not c or mark[1] != c.started or mark[2] != c.requests:
                self._marks[rid] = (c, c.started, c.requests)
                self._diff(rid, set(c.held_keys()), held, freed)
        # left the fleet: its keys freed and its mark forgotten, whether it had keys or not (a
        # replica has keys in ``_sent`` only after a mark was set for it, and loses both at once)
        for rid in [r for r in self._marks if r not in seen]:
            self._marks.pop(rid, None)
            self._diff(rid, set(), held, freed)
        return {"load": load, "held": held, "freed": freed}

    def _diff(self, rid: str, now: set[int], held: dict[str, list[int]], freed: dict[str, list[int]]) -> None:
        before = self._sent.get(rid, set())
        if added := now - before:
            held[rid] = sorted(added)
        if removed := before - now:
            freed[rid] = sorted(removed)
        if now:
            assert rid in self._marks  # _sent's replicas are among _marks' (report's loop above)
            self._sent[rid] = now
        else:
            self._sent.pop(rid, None)


class LoadTable:
    """Every worker's last load report (the parent's; written by its channel readers only)."""

    def __init__(self) -> None:
        self._figures: dict[int, dict[str, list[Any]]] = {}
        self._held: dict[int, dict[str, set[int]]] = {}
        self._holders: dict[str, dict[int, int]] = {}  # replica -> key -> workers holding it
        self._overlap: dict[str, int] = {}  # replica -> sum over keys of (holders - 1)

    def update(self, worker: int, doc: Mapping[str, Any]) -> None:
        self._figures[worker] = {str(r): list(f) for r, f in doc["load"].items()}
        mine = self._held.setdefault(worker, {})
        for replica, keys in doc["held"].items():
            self._hold(mine.setdefault(str(replica), set()), str(replica), keys)
        for replica, keys in doc["freed"].items():
            self._free(mine.get(str(replica), set()), str(replica), keys)
        for replica in [r for r, ks in mine.items() if not ks]:
            del mine[replica]

    def drop(self, worker: int) -> None:
        """The worker is gone: its flights with it."""
        self._figures.pop(worker, None)
        for replica, keys in self._held.pop(worker, {}).items():
            self._free(keys, replica, list(keys))

    def _hold(self, mine: set[int], replica: str, keys: Iterable[int]) -> None:
        holders = self._holders.setdefault(replica, {})
        for k in keys:
            k = int(k)
            if k in mine:
                continue
            mine.add(k)
            n = holders.get(k, 0)
            holders[k] = n + 1
            if n:
                self._overlap[replica] = self._overlap.get(replica, 0) + 1

    def _free(self, mine: set[int], replica: str, keys: Iterable[int]) -> None:
        holders = self._holders.get(replica, {})
        for k in keys:
            k = int(k)
            if k not in mine:
                continue
            mine.discard(k)
            n = holders[k] - 1
            if n:
                holders[k] = n
                self._overlap[replica] -= 1
            else:
                del holders[k]
        if not holders:
            self._holders.pop(replica, None)
            self._overlap.pop(replica, None)

    def others(self, but: int | None) -> dict[str, list[Any]]:
        """Per replica, what worker ``but`` adds to its own flights: the other workers' summed
        requests, tokens, prefill, pairs and shared tokens, the oldest start among them (None:
        none), and the blocks held by more than one worker."""
        out: dict[str, list[Any]] = {}
        for number, figures in self._figures.items():
            if number == but:
                continue
            for replica, f in figures.items():
                t = out.setdefault(replica, [0, 0, 0, 0.0, 0, None, 0])
                for i in range(_SUMMED):
                    t[i] += f[i]
                if f[5] is not None and (t[5] is None or f[5] < t[5]):
                    t[5] = f[5]
        self._add_overlap(out)
        return out

    def others_each(self, workers: Iterable[int]) -> dict[int, dict[str, list[Any]]]:
        """``others(n)`` for each worker ``n`` of ``workers``, from one pass over the figures
        (``others`` per worker is quadratic in the workers: the parent relays load every
        ``LOAD_RELAY_S``). Equal to it: the summed figures are integers (requests, tokens,
        prefill, shared tokens) or attention pairs, integers too (``u x (c + (u + 1) / 2)``), so
        taking a worker's own figures out of the total is exact; the oldest start is the earliest
        of the two earliest that is not the worker's."""
        # per replica: the five sums, the workers reporting it, the earliest start and its
        # worker, the second earliest start (None: fewer)
        totals: dict[str, list[Any]] = {}
        for number, figures in self._figures.items():
            for replica, f in figures.items():
                t = totals.get(replica)
                if t is None:
                    totals[replica] = [f[0], f[1], f[2], f[3], f[4], 1, f[5], number, None]
                    continue
                t[0] += f[0]
                t[1] += f[1]
                t[2] += f[2]
                t[3] += f[3]
                t[4] += f[4]
                t[5] += 1
                start = f[5]
                if start is not None:
                    if t[6] is None or start < t[6]:
                        t[6], t[7], t[8] = start, number, t[6]
                    elif t[8] is None or start < t[8]:
                        t[8] = start
        out: dict[int, dict[str, list[Any]]] = {}
        for w in workers:
            mine = self._figures.get(w, {})
            o: dict[str, list[Any]] = {}
            for replica, t in totals.items():
                own = mine.get(replica)
                if own is None:
                    o[replica] = [t[0], t[1], t[2], t[3], t[4], t[6], 0]
                elif t[5] > 1:  # else only this worker's flights are there
                    start = t[8] if t[7] == w else t[6]
                    o[replica] = [
                        t[0] - own[0],
                        t[1] - own[1],
                        t[2] - own[2],
                        t[3] - own[3],
                        t[4] - own[4],
                        start,
                        0,
                    ]
            self._add_overlap(o)
            out[w] = o
        return out

    def _add_overlap(self, out: dict[str, list[Any]]) -> None:
        for replica, blocks in self._overlap.items():
            if blocks:
                out.setdefault(replica, [0, 0, 0, 0.0, 0, None, 0])[6] = blocks


def remote_loads(doc: Mapping[str, Any], block_size: Callable[[str], int]) -> dict[str, RemoteLoad]:
    """The parent's ``others`` for this worker as each replica's ``RemoteLoad`` (``block_size``:
    the tokens of one of the replica's blocks, which the overlap is counted in)."""
    out = {}
    for r, f in doc.items():
        overlap = int(f[6]) * block_size(str(r)) if f[6] else 0
        out[str(r)] = RemoteLoad(
            int(f[0]),
            int(f[1]),
            int(f[2]),
            prefill_pairs=float(f[3]),
            shared_tokens=int(f[4]) + overlap,
            oldest_pending=None if f[5] is None else float(f[5]),
            overlap_tokens=overlap,
        )
    return out
