"""A replica's load besides this gateway's own flights (docs/architecture.md, "Fleet"): what its
engine reports and what the other gateway instances routed there.

Both values are immutable; ``Fleet`` is their only writer (``agent_load``, ``agent_state`` and
``apply_remote_load``) and replaces them whole. This gateway's own flights are
``router_policies.placement.FlightCounters``, written only by ``Flight``.
"""

from __future__ import annotations

from dataclasses import dataclass

from router_policies.placement import FlightCounters, ReplicaLoad


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """From the engine's /metrics via an agent (here, or another instance's); zero when unknown."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class RemoteLoad:
    """Load other gateway instances report for one replica (``engine``: running, waiting, KV usage
    from the instance holding the replica's agent, when one does)."""

    requests: int
    tokens: int
    prefill: int
    engine: tuple[int, int, float] | None = None


NO_REMOTE_LOAD = RemoteLoad(0, 0, 0)


def combined_load(flights: FlightCounters, remote: RemoteLoad, engine: EngineLoad) -> ReplicaLoad:
    """What a policy sees: this gateway's flights plus the other instances', and the engine's."""
    return ReplicaLoad(
        in_flight_requests=flights.requests + remote.requests,
        in_flight_tokens=flights.tokens + remote.tokens,
        pending_prefill_tokens=flights.pending_prefill_tokens + remote.prefill,
        engine_running=engine.running,
        engine_waiting=engine.waiting,
        kv_usage=engine.kv_usage,
    )
