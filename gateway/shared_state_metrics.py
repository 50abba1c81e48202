"""Prometheus metrics of the Redis shared state, on the app's registry."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from gateway.metric_specs import Metric, MetricSet


class SharedStateMetrics(MetricSet):
    # one metric a line: kind, name, help, labels
    # fmt: off
    up = Metric(Gauge, "kvgate_shared_state_up", "1 while the gateway is connected to the shared Redis.")
    errors = Metric(Counter, "kvgate_shared_state_errors", "Shared-state failures by kind (connection, decode, index_bound, refused_replica).", ("kind",))
    lag = Metric(Gauge, "kvgate_shared_state_lag_seconds", "Age of the last remote inventory entry applied, when it was applied (publisher's clock).")
    published = Metric(Counter, "kvgate_shared_state_published", "Entries published to Redis by kind (delta, snapshot, hello).", ("kind",))
    applied = Metric(Counter, "kvgate_shared_state_applied", "Remote inventory entries applied to the local index by kind (delta, snapshot).", ("kind",))
    dropped = Metric(Counter, "kvgate_shared_state_dropped", "Entries not published: queue_full (oldest dropped) or down (Redis unreachable); the replica's next snapshot supersedes them.", ("reason",))
    resyncs = Metric(Counter, "kvgate_shared_state_resyncs", "Remote replicas reloaded from their snapshot, by cause (bootstrap, marker, gap).", ("reason",))
    queue = Metric(Gauge, "kvgate_shared_state_publish_queue", "Entries waiting to be published.")
    remote_replicas = Metric(Gauge, "kvgate_shared_state_remote_replicas", "Replicas whose inventory this instance follows through Redis.")
    instances = Metric(Gauge, "kvgate_shared_state_instances", "Other gateway instances whose load was read in the last round.")
    # fmt: on
