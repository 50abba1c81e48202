"""Prometheus metrics of the inventory server, created on a registry the caller owns."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Refusal reasons, the values of the ``reason`` label of kvgate_inventory_streams_refused_total.
REFUSAL_REASONS = ("auth", "malformed", "protocol", "hello_refused", "block_bound", "superseded")


class InventoryMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events_applied = Counter(
            "kvgate_inventory_events_applied",
            "Agent events applied to the prefix index, by kind (stored/removed: blocks; cleared: events).",
            ["kind"],
            registry=registry,
        )
        self.snapshots_applied = Counter(
            "kvgate_inventory_snapshots_applied",
            "Full replica snapshots applied to the index.",
            registry=registry,
        )
        self.gaps = Counter(
            "kvgate_inventory_gaps",
            "Sequence gaps: 'stream' on an agent stream; 'engine_recovered'/'engine_unrecovered' "
            "in the engine's events, as the agents report them.",
            ["kind"],
            registry=registry,
        )
        self.resyncs = Counter(
            "kvgate_inventory_resyncs",
            "Snapshots requested from agents, by reason.",
            ["reason"],
            registry=registry,
        )
        self.lag = Histogram(
            "kvgate_inventory_lag_seconds",
            "Engine event time to index apply time (engine and gateway clocks).",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry,
        )
        self.refused = Counter(
            "kvgate_inventory_streams_refused",
            "Agent streams closed by the gateway, by reason.",
            ["reason"],
            registry=registry,
        )
        self.streams = Gauge(
            "kvgate_inventory_streams",
            "Agent streams currently open.",
            registry=registry,
        )
        self.degraded = Gauge(
            "kvgate_inventory_replica_degraded",
            "1 while a replica's precise inventory may be incomplete.",
            ["replica"],
            registry=registry,
        )
        self.stored = self.events_applied.labels("stored")
        self.removed = self.events_applied.labels("removed")
        self.cleared = self.events_applied.labels("cleared")
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)
        for kind in ("stream", "engine_recovered", "engine_unrecovered"):
            self.gaps.labels(kind)
