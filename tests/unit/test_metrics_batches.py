"""Batched metric children (gateway/metrics.py): what a scrape shows equals the same updates made
directly on prometheus_client's metrics, at every scrape."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.metrics import Batches, Children

BUCKETS = (-10.0, -1.0, 0.0, 0.001, 0.5, 1.0, 2.5, 100.0)


def _pair(name: str) -> tuple[CollectorRegistry, Batches, Histogram, Counter]:
    reg = CollectorRegistry()
    batches = Batches()
    reg.register(batches)
    h = Histogram(name + "_h", "h", ["r"], buckets=BUCKETS, registry=reg)
    c = Counter(name + "_c", "c", ["r"], registry=reg)
    return reg, batches, h, c


def test_batched_updates_scrape_as_direct_ones() -> None:
    rnd = random.Random(7)
    direct_reg, _, dh, dc = _pair("m")
    batched_reg, batches, bh, bc = _pair("m")
    hist, count = Children(bh, batches), Children(bc, batches)
    for scrape in range(5):
        for _ in range(rnd.randrange(0, 300)):
            # values on and around every bound: a value equal to a bound counts in its bucket
            v = rnd.choice([*BUCKETS, rnd.uniform(-20, 200), 1e9])
            r = rnd.choice("ab")
            dh.labels(r).observe(v)
            hist(r).observe(v)
            n = rnd.choice([1, 1, 2.5])
            dc.labels(r).inc(n)
            count(r).inc(n)
        assert _samples(batched_reg) == _samples(direct_reg), scrape


def _samples(reg: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(reg).decode().splitlines() if "_created" not in line]
