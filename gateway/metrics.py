"""Prometheus metrics on a registry the app owns (no global default registry).

Counters and histograms are updated on the request path; gauges that mirror state (index size,
fleet health and load, prediction-audit fractions) are read at scrape time by a collector, so the
hot path never maintains them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, overload

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.fleet import Fleet
from gateway.metric_specs import Metric as Spec
from gateway.metric_specs import MetricSet
from gateway.replica_audit import TTFT_WINDOW
from router_policies.placement import TtftSample
from router_policies.prefix_index import PrefixIndex

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_TOKEN_BUCKETS = (0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 1, 16, 64, 256, 1024, 4096)
# relative TTFT error (predicted - observed) / observed: -1 is a prediction of 0 ms
_RELATIVE_BUCKETS = (-0.9, -0.5, -0.3, -0.2, -0.1, -0.05, 0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


class BatchedHistogram:
    """A histogram child's observations counted in plain Python numbers and added to it at once
    (``flush``, when the registry is collected): ``Histogram.observe`` takes a lock twice and
    walks the buckets in Python, several microseconds per call, several calls per request.
    Event-loop thread only; what the exposition shows is exact at every scrape."""

    __slots__ = ("_bounds", "_child", "_counts", "_sum")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._bounds: list[float] = list(child._upper_bounds)  # ends with +Inf
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def observe(self, amount: float) -> None:
        # the bucket ``Histogram.observe`` counts it in: the first bound >= amount
        self._counts[bisect.bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def flush(self) -> None:
        counts = self._counts
        if not any(counts):
            return
        self._counts = [0] * len(counts)
        child, total, self._sum = self._child, self._sum, 0.0
        child._sum.inc(total)
        for i, n in enumerate(counts):
            if n:
                child._buckets[i].inc(n)


class BatchedCounter:
    """A counter child's increments summed here and added to it at once (``BatchedHistogram``)."""

    __slots__ = ("_child", "_pending")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._pending = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._pending += amount

    def flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, 0.0
            self._child.inc(pending)


Batched = BatchedHistogram | BatchedCounter


class Batches:
    """Every batched child, flushed into its metric before the registry is collected: the first
    collector registered (a registry collects in registration order)."""

    def __init__(self) -> None:
        self.children: list[Batched] = []

    @overload
    def of(self, metric: Histogram) -> BatchedHistogram: ...
    @overload
    def of(self, metric: Any) -> Batched: ...
    def of(self, metric: Any) -> Batched:
        """``metric`` (a histogram or counter, or a child of one) batched, flushed with the rest."""
        b: Batched = BatchedHistogram(metric) if isinstance(metric, Histogram) else BatchedCounter(metric)
        self.children.append(b)
        return b

    def collect(self) -> Iterator[Metric]:
        for b in self.children:
            b.flush()
        return iter(())


class Children:
    """A labelled metric's children cached by label values (``labels()`` costs several
    microseconds per call, on every request), batched (``Batches``). Bounded by the label values
    themselves (policies, replicas, statuses, outcomes), which the metric keeps children for
    anyway."""

    __slots__ = ("_batches", "_cache", "_metric")

    def __init__(self, metric: Any, batches: Batches) -> None:
        self._metric = metric
        self._batches = batches
        self._cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._batches.of(self._metric.labels(*values))
        return child


class _StateCollector(Collector):
    """Index size and fleet state, read when Prometheus scrapes."""

    def __init__(
        self, index: PrefixIndex, fleet: Fleet, cache_stats: Callable[[], Mapping[str, int]]
    ) -> None:
        self._index = index
        self._fleet = fleet
        self._cache_stats = cache_stats

    def collect(self) -> Iterator[Metric]:
        cache = self._cache_stats()
        for name in ("entries", "capacity"):
            g = GaugeMetricFamily(f"kvgate_tokenize_cache_{name}", f"Tokenized-segment cache {name}.")
            g.add_metric([], cache.get(name, 0))
            yield g
        for name in ("hits", "misses", "evictions"):
            c = CounterMetricFamily(
                f"kvgate_tokenize_cache_{name}",
                f"Tokenized-segment cache {name} (of the featurizer in use; a reload that changes "
                "models or tokenization settings starts a new one).",
            )
            c.add_metric([], cache.get(name, 0))
            yield c
        for name, what in (
            ("deferred", "Requests routed on their cached prefix, their new text encoded after routing."),
            ("deferred_encoded", "Deferred encodes done (their segments are now cached)."),
            ("deferred_expedited", "Deferred encodes taken over by a request carrying the same new text."),
            (
                "deferred_expedited_heads",
                "Takeovers that encoded only the leading segments the two requests share.",
            ),
            (
                "deferred_heads_first",
                "Leading new segments of queued deferred encodes encoded ahead of the queue.",
            ),
            (
                "deferred_lulls",
                "Times the deferred encoder waited for arrivals to pause before a queued encode (started or expired).",
            ),
            ("deferred_dropped", "Deferred encodes dropped from a full backlog."),
            (
                "deferred_expired",
                "Deferred encodes not done: arrivals did not pause within tokenize_defer_max_wait_s.",
            ),
            (
                "deferred_resumed",
                "Deferred encodes of a text whose head came from prefix checkpoints that encoded only the text after them.",
            ),
            (
                "checkpoint_heads",
                "Heads of text seen before taken from prefix checkpoints instead of encoded from the start.",
            ),
            (
                "checkpoint_refused",
                "Continuations from a prefix checkpoint refused: the context word came back changed.",
            ),
            (
                "checkpoint_mismatches",
                "Heads from prefix checkpoints their full encode contradicted (checkpoints then off).",
            ),
            ("memo_cache_hits", "Template outputs and prompt keys found in the memo cache."),
            ("memo_cache_misses", "Template outputs and prompt keys computed (and remembered)."),
        ):
            c = CounterMetricFamily(f"kvgate_tokenize_{name}", what)
            c.add_metric([], cache.get(name, 0))
            yield c
        for name, what in (
            ("deferred_backlog_chars", "Characters waiting to be encoded after routing."),
            ("seen_entries", "Fingerprints in the record of texts seen."),
        ):
            g = GaugeMetricFamily(f"kvgate_tokenize_{name}", what)
            g.add_metric([], cache.get(name, 0))
            yield g
        keys = GaugeMetricFamily("kvgate_index_keys", "Distinct block keys in the prefix index.")
        keys.add_metric([], len(self._index))
        yield keys
        table = GaugeMetricFamily("kvgate_index_table_bytes", "Memory held by the index's hash table.")
        table.add_metric([], self._index.table_bytes())
        yield table
        entries = GaugeMetricFamily(
            "kvgate_index_entries", "Index entries per replica and kind.", labels=["replica", "kind"]
        )
        for rid, st in self._index.stats().items():
            entries.add_metric([rid, "precise"], st["precise"])
            entries.add_metric([rid, "approximate"], st["approximate"])
        yield entries
        healthy = GaugeMetricFamily(
            "kvgate_replica_healthy", "1 when the replica is routable.", labels=["replica"]
        )
        inflight = GaugeMetricFamily(
            "kvgate_replica_in_flight_requests", "Requests routed and not finished.", labels=["replica"]
        )
        pending = GaugeMetricFamily(
            "kvgate_replica_pending_prefill_tokens",
            "Uncached prompt tokens routed and awaiting a first byte.",
            labels=["replica"],
        )
        exact = GaugeMetricFamily(
            "kvgate_prediction_exact_fraction",
            "Share of audited requests whose predicted cached tokens equal the engine's report.",
            labels=["replica"],
        )
        ttft_mae = GaugeMetricFamily(
            "kvgate_ttft_prediction_median_abs_error",
            f"Median absolute relative error of the TTFT model's predictions (last {TTFT_WINDOW} first tokens).",
            labels=["replica"],
        )
        for rec in self._fleet.records():
            mae = rec.ttft_audit.median_abs_error()
            if mae is not None:
                ttft_mae.add_metric([rec.id], mae)
            healthy.add_metric([rec.id], 1.0 if rec.health.healthy else 0.0)
            inflight.add_metric([rec.id], rec.flights.requests)
            pending.add_metric([rec.id], rec.flights.pending_prefill_tokens)
            fraction = rec.audit.exact_fraction
            if fraction is not None:
                exact.add_metric([rec.id], fraction)
        yield healthy
        yield inflight
        yield pending
        yield exact
        yield ttft_mae


class GatewayMetrics(MetricSet):
    # one metric a line: kind, name, help, labels (and buckets)
    # fmt: off
    requests = Spec(Counter, "kvgate_requests", "Proxied requests by policy, replica (none when not routed) and HTTP status.", ("policy", "replica", "status"))
    retries = Spec(Counter, "kvgate_retries", "Attempts retried on another replica, by cause.", ("reason",))
    features_seconds = Spec(Histogram, "kvgate_features_seconds", "Request features per request: chat template, tokenization, block keys.", buckets=_DECISION_BUCKETS)
    decision_seconds = Spec(Histogram, "kvgate_decision_seconds", "Index match, fleet snapshot, policy choice and speculative index entry per request.", buckets=_DECISION_BUCKETS)
    predicted_tokens = Spec(Histogram, "kvgate_predicted_matched_tokens", "Cached prompt tokens predicted on the chosen replica.", ("policy",), _TOKEN_BUCKETS)
    ttft_seconds = Spec(Histogram, "kvgate_ttft_seconds", "Time to the first upstream byte, seen through the proxy.", ("replica",), _LATENCY_BUCKETS)
    e2e_seconds = Spec(Histogram, "kvgate_e2e_seconds", "Request start to last byte, seen through the proxy.", ("replica",), _LATENCY_BUCKETS)
    audit = Spec(Counter, "kvgate_prediction_audit", "Requests whose engine reported cached tokens, by outcome (exact, over, under).", ("replica", "outcome"))
    audit_error = Spec(Histogram, "kvgate_prediction_error_tokens", "Predicted minus engine-reported cached tokens.", ("replica",), _ERROR_BUCKETS)
    audit_cause = Spec(Counter, "kvgate_prediction_audit_inexact", "Inexact cached-token predictions by cause (concurrent_not_stored, evicted, stale_index, eviction_estimate, not_yet_reported, tokenization).", ("replica", "cause"))
    ttft_error = Spec(Histogram, "kvgate_ttft_prediction_relative_error", "TTFT model: (predicted - observed) / observed time to first byte, per first token.", ("replica",), _RELATIVE_BUCKETS)
    features = Spec(Counter, "kvgate_features", "Requests featurized, by how the tokens were obtained (local, remote, token_ids, chars) and whether the keys are approximate character blocks.", ("mode", "approximate"))
    reloads = Spec(Counter, "kvgate_config_reloads", "Config reloads by result.", ("result",))
    # fmt: on

    def __init__(
        self,
        registry: CollectorRegistry,
        index: PrefixIndex,
        fleet: Fleet,
        cache_stats: Callable[[], Mapping[str, int]],
    ) -> None:
        self.registry = registry
        # batched request-path updates, flushed before anything else is collected
        self.batches = Batches()
        registry.register(self.batches)
        super().__init__(registry)
        # request-path access to the labelled metrics, through cached children
        b = self.batches
        self.features_time = b.of(self.features_seconds)
        self.decision_time = b.of(self.decision_seconds)
        self.requests_by = Children(self.requests, b)
        self.retries_by = Children(self.retries, b)
        self.predicted_by = Children(self.predicted_tokens, b)
        self.ttft_by = Children(self.ttft_seconds, b)
        self.e2e_by = Children(self.e2e_seconds, b)
        self.audit_by = Children(self.audit, b)
        self.audit_error_by = Children(self.audit_error, b)
        self.features_by = Children(self.features, b)
        self.ttft_error_by = Children(self.ttft_error, b)
        self.audit_cause_by = Children(self.audit_cause, b)
        fleet.ttft_listener = self._ttft_sample
        registry.register(_StateCollector(index, fleet, cache_stats))

    def _ttft_sample(self, sample: TtftSample) -> None:
        self.ttft_error_by(sample.replica).observe(sample.relative_error)
