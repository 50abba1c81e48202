"""What the live bench reads from Prometheus text (bench/live.py): the engines' prefix-cache
counters and time-to-first-token histograms (summed over the fleet, as deltas over a run), and
kvgate's own prediction audits.

A histogram's quantile is read as Prometheus' ``histogram_quantile`` does: linear within the
bucket holding it (the sim-engine's buckets are at most ~1.35x apart up to 10 s, so a p99 read
there is within that bucket's width).
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterable, Mapping

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
ENGINE_TTFT = "vllm:time_to_first_token_seconds_bucket"


def scrape(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as r:
        return str(r.read().decode())


def samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        try:
            yield m.group(1), labels, float(m.group(3))
        except ValueError:
            continue


def sums(texts: Iterable[str], names: Iterable[str]) -> dict[str, float]:
    """Per name, the sum of its samples over every text (every label set)."""
    wanted = set(names)
    out = dict.fromkeys(wanted, 0.0)
    for text in texts:
        for name, _labels, value in samples(text):
            if name in wanted:
                out[name] += value
    return out


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


def kvgate_audit(text: str) -> dict[str, object]:
    """kvgate's audits from its /metrics: the TTFT model's median absolute relative error (each
    replica's, weighted by its first tokens; with several workers, each worker's audit of each
    replica: the samples are labelled ``worker``), the cached-token audit's exact share and its
    inexact predictions by cause (``cached_audit_causes``: cause -> count, summed over the
    replicas; the causes of gateway/prediction_audit.py)."""
    mae: dict[tuple[str, str], float] = {}
    counts: dict[tuple[str, str], float] = {}
    outcomes: dict[str, float] = {}
    causes: dict[str, float] = {}
    for name, labels, value in samples(text):
        if name == "kvgate_ttft_prediction_median_abs_error":
            mae[labels.get("worker", ""), labels["replica"]] = value
        elif name == "kvgate_ttft_prediction_relative_error_count":
            counts[labels.get("worker", ""), labels["replica"]] = value
        elif name == "kvgate_prediction_audit_total":
            outcomes[labels["outcome"]] = outcomes.get(labels["outcome"], 0.0) + value
        elif name == "kvgate_prediction_audit_inexact_total":
            causes[labels["cause"]] = causes.get(labels["cause"], 0.0) + value
    weight = sum(counts.get(r, 0.0) for r in mae)
    audited = sum(outcomes.values())
    return {
        "ttft_audit_median_abs_error": (
            sum(v * counts.get(r, 0.0) for r, v in mae.items()) / weight if weight else None
        ),
        "ttft_audit_first_tokens": int(sum(counts.values())),
        "cached_audit_exact_fraction": outcomes.get("exact", 0.0) / audited if audited else None,
        "cached_audit_requests": int(audited),
        "cached_audit_causes": {k: int(v) for k, v in sorted(causes.items())},
    }
