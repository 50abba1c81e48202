"""A seeded walk of flights started and ended on several workers' counters, beside one process's
count of every flight (the workers' load tests: tests/integration/test_workers_load.py,
tests/unit/test_workers_shared_load.py)."""

from __future__ import annotations

import random
from collections.abc import Iterator

from gateway.replica_record import ReplicaRecord
from router_policies.flights import Flight, FlightCounters

BLOCK = 16


def walk(
    seed: int, workers: list[ReplicaRecord], whole: FlightCounters, steps: int = 400
) -> Iterator[tuple[int, int, float]]:
    """After each change, (step, the worker whose flights changed, now): a new flight on a random
    worker (a random prefix predicted cached), or a random flight's end, after its first byte or
    not. ``whole`` gets the same flights."""
    rng = random.Random(seed)
    prefixes = [[1000 * p + i for i in range(rng.randint(1, 12))] for p in range(6)]
    flights: list[tuple[int, Flight, Flight]] = []
    now = 0.0
    for step in range(steps):
        now += 0.01
        if flights and rng.random() < 0.45:
            w, mine, ref = flights.pop(rng.randrange(len(flights)))
            if rng.random() < 0.5:
                mine.first_byte()
                ref.first_byte()
            mine.end()
            ref.end()
        else:
            w = rng.randrange(len(workers))
            keys = rng.choice(prefixes)[: rng.randint(0, 12)]
            args = (rng.randint(1, 900), rng.randint(0, 300), float(rng.randint(0, 9999)))
            mine = Flight(workers[w].flights, *args, cached_keys=keys, block_size=BLOCK, start=now)
            flights.append((w, mine, Flight(whole, *args, cached_keys=keys, block_size=BLOCK, start=now)))
        yield step, w, now
