"""Prometheus text exposition read back (docs/architecture.md, section 2, kvgate_tools): its
samples, sums of named samples over several scrapes, and kvgate's own audits from its
``/metrics``. Shared by ``kvgate demo`` (kvgate_tools/demo.py), the live bench
(bench/live_metrics.py) and the e2e harness.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TypedDict

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


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


class KvgateAudit(TypedDict):
    ttft_audit_median_abs_error: float | None
    ttft_audit_first_tokens: int
    cached_audit_exact_fraction: float | None
    cached_audit_requests: int
    cached_audit_causes: dict[str, int]


def kvgate_audit(text: str) -> KvgateAudit:
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
