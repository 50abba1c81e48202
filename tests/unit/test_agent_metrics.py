"""The agent's /metrics (replica_agent/agent_metrics.py): every family shows the counter it names,
read from the agent's real subscriber, inventory and gateway client at scrape time."""

from __future__ import annotations

import dataclasses

import zmq.asyncio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from replica_agent.agent import Agent, AgentConfig
from replica_agent.agent_metrics import agent_registry
from replica_agent.gateway_client import GatewayClient, Link, Sources
from replica_agent.inventory import AgentInventory
from replica_agent.subscriber import EventSubscriber

# sample (name, label value or "") -> the stats (of "sub", "inv" or "client") and field it shows
COUNTERS = {
    ("kvgate_agent_engine_batches_total", "applied"): ("sub", "batches_applied"),
    ("kvgate_agent_engine_batches_total", "replayed"): ("sub", "replayed_batches"),
    ("kvgate_agent_engine_batches_total", "stale"): ("sub", "stale"),
    ("kvgate_agent_engine_batches_total", "malformed"): ("sub", "malformed_frames"),
    ("kvgate_agent_malformed_events_total", ""): ("sub", "malformed_events"),
    ("kvgate_agent_engine_gaps_total", "recovered"): ("sub", "recovered_gaps"),
    ("kvgate_agent_engine_gaps_total", "unrecovered"): ("sub", "unrecovered_gaps"),
    ("kvgate_agent_engine_tail_probes_total", ""): ("sub", "tail_probes"),
    ("kvgate_agent_engine_restarts_total", ""): ("sub", "engine_restarts"),
    ("kvgate_agent_engine_disconnects_total", ""): ("sub", "engine_disconnects"),
    ("kvgate_agent_blocks_total", "stored"): ("inv", "stored_blocks"),
    ("kvgate_agent_blocks_total", "removed"): ("inv", "removed_blocks"),
    ("kvgate_agent_blocks_total", "skipped"): ("inv", "skipped_blocks"),
    ("kvgate_agent_blocks_total", "unknown_removals"): ("inv", "unknown_removals"),
    ("kvgate_agent_blocks_total", "overflow_evictions"): ("inv", "overflow_evictions"),
    ("kvgate_agent_blocks_total", "adopted"): ("inv", "adopted_blocks"),
    ("kvgate_agent_blocks_total", "confirmed"): ("inv", "confirmed_blocks"),
    ("kvgate_agent_gateway_connects_total", ""): ("client", "connects"),
    ("kvgate_agent_gateway_failures_total", ""): ("client", "failures"),
    ("kvgate_agent_snapshots_sent_total", ""): ("client", "snapshots_sent"),
}


def _samples(agent: Agent) -> dict[tuple[str, str], float]:
    text = generate_latest(agent_registry(agent)).decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_created"):
                label = next(iter(s.labels.values()), "")
                assert (s.name, label) not in out, s
                out[s.name, label] = s.value
    return out


def test_every_family_shows_its_counter() -> None:
    agent = Agent(AgentConfig("r0", "http://127.0.0.1:1", "tcp://127.0.0.1:2", "127.0.0.1:3"))
    assert _samples(agent) == {("kvgate_agent_probe_errors_total", ""): 0}  # nothing started yet
    inv = AgentInventory("m", 16, 100)
    ctx = zmq.asyncio.Context()
    try:
        agent.inventory = inv
        agent.subscriber = EventSubscriber(ctx, "tcp://127.0.0.1:2", None, inv)
        agent.client = GatewayClient(Link("127.0.0.1:3"), Sources(inv, agent.outbox, lambda: None))
        stats = {"sub": agent.subscriber.stats, "inv": inv.stats, "client": agent.client.stats}
        # a distinct value in every counter, so a family reading the wrong one shows it
        n = 100
        for st in stats.values():
            for f in dataclasses.fields(st):
                if isinstance(getattr(st, f.name), int):
                    n += 1
                    setattr(st, f.name, n)
        agent.probe_errors = 7
        inv.degraded = True
        agent.client.connected.set()
        want = {key: float(getattr(stats[part], field)) for key, (part, field) in COUNTERS.items()}
        want |= {
            ("kvgate_agent_probe_errors_total", ""): 7,
            ("kvgate_agent_inventory_blocks", ""): 0,
            ("kvgate_agent_orphan_bytes", ""): 0,
            ("kvgate_agent_degraded", ""): 1,
            ("kvgate_agent_gateway_connected", ""): 1,
        }
        assert _samples(agent) == want
    finally:
        ctx.term()
