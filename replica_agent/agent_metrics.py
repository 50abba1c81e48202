"""The agent's Prometheus metrics: its counters, read when scraped (no global registry, no copies).

Served on ``kvgate agent --metrics-port P`` at ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from replica_agent.agent import Agent


class AgentCollector:
    """Reads the agent's subscriber, inventory and client counters at scrape time."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        sub, inv, client = a.subscriber, a.inventory, a.client
        if sub is not None:
            st = sub.stats
            c = CounterMetricFamily(
                "kvgate_agent_engine_batches", "Engine event batches, by outcome.", labels=["outcome"]
            )
            c.add_metric(["applied"], st.batches_applied)
            c.add_metric(["replayed"], st.replayed_batches)
            c.add_metric(["stale"], st.stale)
            c.add_metric(["malformed"], st.malformed_frames)
            yield c
            yield CounterMetricFamily(
                "kvgate_agent_malformed_events",
                "Single events that did not decode.",
                value=st.malformed_events,
            )
            g = CounterMetricFamily(
                "kvgate_agent_engine_gaps", "Engine seq gaps, by outcome.", labels=["outcome"]
            )
            g.add_metric(["recovered"], st.recovered_gaps)
            g.add_metric(["unrecovered"], st.unrecovered_gaps)
            yield g
            yield CounterMetricFamily(
                "kvgate_agent_engine_tail_probes",
                "Replay asked after a quiet period, for batches lost with none after them.",
                value=st.tail_probes,
            )
            yield CounterMetricFamily(
                "kvgate_agent_engine_restarts", "Engine restarts seen (seq reset).", value=st.engine_restarts
            )
            yield CounterMetricFamily(
                "kvgate_agent_engine_disconnects",
                "Engine event publisher disconnects.",
                value=st.engine_disconnects,
            )
        if inv is not None:
            s = inv.stats
            b = CounterMetricFamily(
                "kvgate_agent_blocks", "Engine blocks, by what happened.", labels=["kind"]
            )
            for kind in (
                "stored_blocks",
                "removed_blocks",
                "skipped_blocks",
                "unknown_removals",
                "overflow_evictions",
                "adopted_blocks",  # recovery without replay (recovery.py)
                "confirmed_blocks",
            ):
                b.add_metric([kind.replace("_blocks", "")], getattr(s, kind))
            yield b
            yield GaugeMetricFamily(
                "kvgate_agent_inventory_blocks", "Blocks the agent holds.", value=len(inv)
            )
            yield GaugeMetricFamily(
                "kvgate_agent_orphan_bytes",
                "Estimated bytes of stored blocks kept until their parent is learnt.",
                value=inv.orphans.bytes,
            )
            yield GaugeMetricFamily(
                "kvgate_agent_degraded",
                "1 while the inventory may miss blocks.",
                value=1 if inv.degraded else 0,
            )
        if client is not None:
            cs = client.stats
            yield GaugeMetricFamily(
                "kvgate_agent_gateway_connected",
                "1 while the inventory stream is open.",
                value=1 if client.connected.is_set() else 0,
            )
            yield CounterMetricFamily(
                "kvgate_agent_gateway_connects", "Streams established.", value=cs.connects
            )
            yield CounterMetricFamily(
                "kvgate_agent_gateway_failures", "Streams that failed.", value=cs.failures
            )
            yield CounterMetricFamily(
                "kvgate_agent_snapshots_sent", "Full snapshots sent.", value=cs.snapshots_sent
            )
        yield CounterMetricFamily("kvgate_agent_probe_errors", "Failed /metrics polls.", value=a.probe_errors)


def agent_registry(agent: Agent) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    return registry
