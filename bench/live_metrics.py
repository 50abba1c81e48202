"""What the live bench reads from Prometheus text (bench/live.py): the engines' prefix-cache
counters and time-to-first-token histograms (summed over the fleet, as deltas over a run), and
kvgate's own prediction audits (the sample reader and the audits are kvgate_tools/prom_text.py's,
which ``kvgate demo`` shares).

A histogram's quantile is read as Prometheus' ``histogram_quantile`` does: linear within the
bucket holding it (the sim-engine's buckets are at most ~1.35x apart up to 10 s, so a p99 read
there is within that bucket's width).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Mapping

from kvgate_tools.prom_text import kvgate_audit as kvgate_audit  # re-exported: bench/live.py
from kvgate_tools.prom_text import samples
from kvgate_tools.prom_text import sums as sums  # re-exported: bench/live.py

ENGINE_TTFT = "vllm:time_to_first_token_seconds_bucket"


def scrape(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as r:
        return str(r.read().decode())


def buckets(texts: Iterable[str], name: str = ENGINE_TTFT) -> dict[float, float]:
    """Cumulative bucket counts by upper bound, summed over the texts (several engines)."""
    out: dict[float, float] = {}
    for text in texts:
        for n, labels, value in samples(text):
            if n == name and "le" in labels:
                le = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
                out[le] = out.get(le, 0.0) + value
    return out


def delta(after: Mapping[float, float], before: Mapping[float, float]) -> dict[float, float]:
    return {le: v - before.get(le, 0.0) for le, v in after.items()}


def quantile(cumulative: Mapping[float, float], q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram (None when empty); linear within its bucket,
    the last finite bound when it falls in the +Inf bucket."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    total = cumulative[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = cumulative[le]
        if count >= rank:
            if le == float("inf"):
                return lower
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, count
    return lower
