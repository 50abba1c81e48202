"""Prometheus metrics of the Redis shared state, on the app's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class SharedStateMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge(
            "kvgate_shared_state_up",
            "1 while the gateway is connected to the shared Redis.",
            registry=registry,
        )
        self.errors = Counter(
            "kvgate_shared_state_errors",
            "Shared-state failures by kind (connection, decode, index_bound, refused_replica).",
            ["kind"],
            registry=registry,
        )
        self.lag = Gauge(
            "kvgate_shared_state_lag_seconds",
            "Age of the last remote inventory entry applied, when it was applied (publisher's clock).",
            registry=registry,
        )
        self.published = Counter(
            "kvgate_shared_state_published",
            "Entries published to Redis by kind (delta, snapshot, hello).",
            ["kind"],
            registry=registry,
        )
        self.applied = Counter(
            "kvgate_shared_state_applied",
            "Remote inventory entries applied to the local index by kind (delta, snapshot).",
            ["kind"],
            registry=registry,
        )
        self.dropped = Counter(
            "kvgate_shared_state_dropped",
            "Entries not published: queue_full (oldest dropped) or down (Redis unreachable); the "
            "replica's next snapshot supersedes them.",
            ["reason"],
            registry=registry,
        )
        self.resyncs = Counter(
            "kvgate_shared_state_resyncs",
            "Remote replicas reloaded from their snapshot, by cause (bootstrap, marker, gap).",
            ["reason"],
            registry=registry,
        )
        self.queue = Gauge(
            "kvgate_shared_state_publish_queue", "Entries waiting to be published.", registry=registry
        )
        self.remote_replicas = Gauge(
            "kvgate_shared_state_remote_replicas",
            "Replicas whose inventory this instance follows through Redis.",
            registry=registry,
        )
        self.instances = Gauge(
            "kvgate_shared_state_instances",
            "Other gateway instances whose load was read in the last round.",
            registry=registry,
        )
