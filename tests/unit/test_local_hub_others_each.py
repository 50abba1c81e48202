"""``LoadTable.others_each`` (gateway/local_hub_load.py): what every worker adds to its own load,
from one pass over the workers' figures, equal to ``others`` worker by worker on random reports
(figures as workers report them: integer attention pairs, starts or none, shared keys)."""

from __future__ import annotations

import random
from typing import Any

from gateway.local_hub_load import LoadTable
from router_policies.ttft.features import attention_pairs


def _report(rng: random.Random, replicas: list[str]) -> dict[str, Any]:
    load: dict[str, list[Any]] = {}
    for r in replicas:
        if rng.random() < 0.6:
            u, c = rng.randrange(0, 50_000), rng.randrange(0, 100_000)
            start = None if rng.random() < 0.3 else round(rng.uniform(0, 100), 3)
            pairs = sum(attention_pairs(u + i, c) for i in range(rng.randrange(1, 4)))
            load[r] = [
                rng.randrange(1, 40),
                rng.randrange(1, 10**6),
                u,
                pairs,
                rng.randrange(0, 5) * 16,
                start,
            ]
    held = {r: sorted(rng.sample(range(200), rng.randrange(0, 20))) for r in replicas if rng.random() < 0.5}
    return {"load": load, "held": held, "freed": {}}


def test_others_each_equals_others_for_every_worker() -> None:
    rng = random.Random(5)
    replicas = [f"r{i}" for i in range(6)]
    for trial in range(60):
        table = LoadTable()
        workers = list(range(rng.randrange(1, 9)))
        for w in workers:
            table.update(w, _report(rng, replicas))
        for w in rng.sample(workers, rng.randrange(0, len(workers))):
            table.update(w, _report(rng, replicas))  # a later report replaces the figures
        if len(workers) > 2 and rng.random() < 0.3:
            table.drop(workers.pop())
        each = table.others_each([*workers, 99])  # 99: a worker with no report yet
        for w in [*workers, 99]:
            assert each[w] == table.others(w), (trial, w)
