"""A fixed-bucket histogram of durations (seconds) with quantiles and a Prometheus family
(docs/architecture.md, "Operator view"). Fixed memory: one count per bucket."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from prometheus_client.core import HistogramMetricFamily

# 0.1 s to ~1 day, roughly x2.5 per bucket: cache residencies and session turn gaps alike
DURATION_BUCKETS: tuple[float, ...] = (
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1800.0, 3600.0, 7200.0, 21600.0, 86400.0,
)  # fmt: skip


class LogHistogram:
    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: Sequence[float] = DURATION_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values: Sequence[float]) -> None:
        """``observe`` of each of ``values``, in that order (the same counts and total)."""
        counts, bounds = self.counts, self.bounds
        total = self.total
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1
            total += value
        self.total = total
        self.count += len(values)

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile ``q`` (inf above the last bound)."""
        if not self.count:
            return None
        rank = q * self.count
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return self.bounds[i] if i < len(self.bounds) else float("inf")
        return float("inf")

    def share_above(self, value: float) -> float | None:
        """The share of observations above the bucket bound at or above ``value``."""
        if not self.count:
            return None
        i = bisect.bisect_left(self.bounds, value)
        return sum(self.counts[i + 1 :]) / self.count

    def summary(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean_s": self.total / self.count if self.count else None,
            "p50_s": self.quantile(0.5),
            "p90_s": self.quantile(0.9),
            "p99_s": self.quantile(0.99),
        }

    def buckets(self) -> list[tuple[float | None, int]]:
        """(upper bound, count) per bucket; None for the bucket above every bound."""
        return [(b, c) for b, c in zip((*self.bounds, None), self.counts, strict=True)]

    def merged(self, other: LogHistogram) -> LogHistogram:
        assert self.bounds == other.bounds
        out = LogHistogram(self.bounds)
        out.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        out.count, out.total = self.count + other.count, self.total + other.total
        return out

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        cumulative, buckets = 0, []
        for bound, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += c
            buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
        family.add_metric(labels, buckets, self.total)
