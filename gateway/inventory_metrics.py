"""Prometheus metrics of the inventory server, created on a registry the caller owns."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.metric_specs import Metric, MetricSet

# Refusal reasons, the values of the ``reason`` label of kvgate_inventory_streams_refused_total.
REFUSAL_REASONS = (
    "auth",
    "malformed",
    "protocol",
    "hello_refused",
    "block_bound",
    "block_size",
    "identity",
    "registration",
    "superseded",
)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class InventoryMetrics(MetricSet):
    # one metric a line: kind, name, help, labels (or buckets)
    # fmt: off
    events_applied = Metric(Counter, "kvgate_inventory_events_applied", "Agent events applied to the prefix index, by kind (stored/removed: blocks; cleared: events).", ("kind",))
    snapshots_applied = Metric(Counter, "kvgate_inventory_snapshots_applied", "Full replica snapshots applied to the index.")
    gaps = Metric(Counter, "kvgate_inventory_gaps", "Sequence gaps: 'stream' on an agent stream; 'engine_recovered'/'engine_unrecovered' in the engine's events, as the agents report them.", ("kind",))
    resyncs = Metric(Counter, "kvgate_inventory_resyncs", "Snapshots requested from agents, by reason.", ("reason",))
    lag = Metric(Histogram, "kvgate_inventory_lag_seconds", "Engine event time to index apply time (engine and gateway clocks).", buckets=_LAG_BUCKETS)
    refused = Metric(Counter, "kvgate_inventory_streams_refused", "Agent streams closed by the gateway, by reason.", ("reason",))
    streams = Metric(Gauge, "kvgate_inventory_streams", "Agent streams currently open.")
    degraded = Metric(Gauge, "kvgate_inventory_replica_degraded", "1 while a replica's precise inventory may be incomplete.", ("replica",))
    # fmt: on

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.stored = self.events_applied.labels("stored")
        self.removed = self.events_applied.labels("removed")
        self.cleared = self.events_applied.labels("cleared")
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)
        for kind in ("stream", "engine_recovered", "engine_unrecovered"):
            self.gaps.labels(kind)
