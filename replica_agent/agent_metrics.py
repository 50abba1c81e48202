"""The agent's Prometheus metrics: its counters, read when scraped (no global registry, no copies).

Served on ``kvgate agent --metrics-port P`` at ``/metrics`` (docs/architecture.md, "Engine KV events
and the agent stream"; the families are listed in docs/agent.md). Each unlabelled family is a row
(name, help, value) of a table; the order of families in the exposition carries no meaning.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from replica_agent.agent import Agent


def _by_label(name: str, doc: str, label: str, values: Iterable[tuple[str, float]]) -> Metric:
    family = CounterMetricFamily(name, doc, labels=[label])
    for value_label, value in values:
        family.add_metric([value_label], value)
    return family


def _counters(rows: Iterable[tuple[str, str, float]]) -> Iterator[Metric]:
    """One unlabelled counter a row of (name, help, value)."""
    for name, doc, value in rows:
        yield CounterMetricFamily(name, doc, value=value)


def _gauges(rows: Iterable[tuple[str, str, float]]) -> Iterator[Metric]:
    """One unlabelled gauge a row of (name, help, value)."""
    for name, doc, value in rows:
        yield GaugeMetricFamily(name, doc, value=value)


class AgentCollector:
    """Reads the agent's subscriber, inventory and client counters at scrape time."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        sub, inv, client = a.subscriber, a.inventory, a.client
        if sub is not None:
            st = sub.stats
            yield _by_label(
                "kvgate_agent_engine_batches",
                "Engine event batches, by outcome.",
                "outcome",
                (
                    ("applied", st.batches_applied),
                    ("replayed", st.replayed_batches),
                    ("stale", st.stale),
                    ("malformed", st.malformed_frames),
                ),
            )
            yield _by_label(
                "kvgate_agent_engine_gaps",
                "Engine seq gaps, by outcome.",
                "outcome",
                (("recovered", st.recovered_gaps), ("unrecovered", st.unrecovered_gaps)),
            )
            yield from _counters(
                (
                    (
                        "kvgate_agent_malformed_events",
                        "Single events that did not decode.",
                        st.malformed_events,
                    ),
                    (
                        "kvgate_agent_engine_tail_probes",
                        "Replay asked after a quiet period, for batches lost with none after them.",
                        st.tail_probes,
                    ),
                    ("kvgate_agent_engine_restarts", "Engine restarts seen (seq reset).", st.engine_restarts),
                    (
                        "kvgate_agent_engine_disconnects",
                        "Engine event publisher disconnects.",
                        st.engine_disconnects,
                    ),
                )
            )
        if inv is not None:
            kinds = (
                "stored_blocks",
                "removed_blocks",
                "skipped_blocks",
                "unknown_removals",
                "overflow_evictions",
                "adopted_blocks",  # recovery without replay (recovery.py)
                "confirmed_blocks",
            )
            yield _by_label(
                "kvgate_agent_blocks",
                "Engine blocks, by what happened.",
                "kind",
                ((kind.replace("_blocks", ""), getattr(inv.stats, kind)) for kind in kinds),
            )
            yield from _gauges(
                (
                    ("kvgate_agent_inventory_blocks", "Blocks the agent holds.", len(inv)),
                    (
                        "kvgate_agent_orphan_bytes",
                        "Estimated bytes of stored blocks kept until their parent is learnt.",
                        inv.orphans.bytes,
                    ),
                    (
                        "kvgate_agent_degraded",
                        "1 while the inventory may miss blocks.",
                        1 if inv.degraded else 0,
                    ),
                )
            )
        if client is not None:
            cs = client.stats
            yield GaugeMetricFamily(
                "kvgate_agent_gateway_connected",
                "1 while the inventory stream is open.",
                value=1 if client.connected.is_set() else 0,
            )
            yield from _counters(
                (
                    ("kvgate_agent_gateway_connects", "Streams established.", cs.connects),
                    ("kvgate_agent_gateway_failures", "Streams that failed.", cs.failures),
                    ("kvgate_agent_snapshots_sent", "Full snapshots sent.", cs.snapshots_sent),
                )
            )
        yield CounterMetricFamily("kvgate_agent_probe_errors", "Failed /metrics polls.", value=a.probe_errors)


def agent_registry(agent: Agent) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    return registry
