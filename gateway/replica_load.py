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
    # the queue the TTFT model reads beside those (FlightCounters' figures; 0 / None when the
    # exchange does not carry them: the Redis one): the attention pairs of the pending prefill,
    # the cached tokens counted more than once over every process's flights (each block pinned
    # once: the other workers' own sharing plus the blocks two processes' flights both hold),
    # and when the oldest of their requests without a first byte started (CLOCK_MONOTONIC, one
    # clock for every process of the host)
    prefill_pairs: float = 0.0
    shared_tokens: int = 0
    oldest_pending: float | None = None
    # of shared_tokens, the blocks two processes' flights both hold (the workers' relay says it;
    # gateway/workers_shared_load.py keeps it when it replaces the other figures)
    overlap_tokens: int = 0


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


def combined_queue(flights: FlightCounters, remote: RemoteLoad, now: float) -> tuple[float, int, float]:
    """The TTFT model's queue figures over this process's flights and the others': pending
    prefill pairs, shared cached tokens, and the pending age in ms at ``now`` (the oldest over
    every process)."""
    age = flights.pending_age_ms(now)
    if remote.oldest_pending is not None:
        age = max(age, (now - remote.oldest_pending) * 1000.0)
    return (
        flights.pending_prefill_pairs + remote.prefill_pairs,
        flights.shared_tokens + remote.shared_tokens,
        age,
    )
