"""The Policy interface (docs/architecture.md, "Policies"): decide, then commit.

``choose(request, fleet)`` is a pure, synchronous function of (request, fleet snapshot, the
policy's private state): it never does I/O, never awaits and never changes the policy, so the
gateway's ``/admin/explain`` can call it on the live policy and a request that is not sent
leaves no trace. ``commit(decision)`` is the one place a policy's private state advances (a
round-robin cursor, a tie-break cursor); callers call it once the decision is used (the gateway
when an attempt is accepted, the simulator per routed request). That state only depends on the
sequence of committed decisions and the seed, so the same inputs and seed always give the same
decisions, in the gateway and in the simulator alike. A cache that cannot change a decision (a
hash ring memoised per replica set) is not state in this sense.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from router_policies.ttft.params import TtftParams


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    model: str
    block_keys: Sequence[int]
    prompt_tokens: int
    block_size: int
    session_id: str | None = None
    lora: str | None = None  # the LoRA adapter the request names (routed to replicas holding it)


@dataclass(frozen=True, slots=True)
class RoomSchedule:
    """A replica's flights (this router's) as its KV cache will see them free room: ``running``,
    (ms since its first token, expected output tokens, KV tokens its end frees) of each flight
    decoding; ``waiting``, (expected output tokens, KV tokens it takes, uncached prompt tokens)
    of each flight still awaiting its first token, in the order they were sent (the engine
    admits them first come, first served); ``pace_ms``, the replica's measured milliseconds per
    output token (0: none measured yet)."""

    pace_ms: float = 0.0
    running: tuple[tuple[float, int, int], ...] = ()
    waiting: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica as the router sees it at decision time."""

    id: str
    healthy: bool = True
    in_flight_requests: int = 0  # routed by this gateway, not finished
    in_flight_tokens: int = 0  # prompt + expected output tokens of those requests
    pending_prefill_tokens: int = 0  # uncached prompt tokens routed here still awaiting a first token
    engine_running: int = 0  # from the engine's /metrics via the agent (may lag)
    engine_waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    matched_blocks: int = (
        0  # request blocks this replica can reuse (index match: leading run, or deepest key)
    )
    # of matched_blocks, the trailing ones its engine is expected to evict before this request's
    # prefill starts (router_policies.cache_prediction.evicted_before_prefill): the queue ahead needs the room
    evicted_blocks: int = 0
    match_score: float = 0.0  # matched_blocks weighted by medium
    held_blocks: int = 0  # how full the index believes its cache is (PrefixIndex.held_count)
    # of matched_blocks, those held on a slower medium than the GPU: ((medium, blocks), ...)
    matched_on_media: tuple[tuple[str, int], ...] = ()
    # causal-attention pairs of that pending prefill: sum over its requests of u (c + (u + 1) / 2),
    # u uncached and c cached tokens (router_policies.ttft.features.attention_pairs); 0: unknown
    pending_prefill_pairs: float = 0.0
    # of in_flight_tokens, cached prompt tokens counted more than once (a prefix block several of
    # those requests share: the engine's KV holds it once); 0: none or unknown
    in_flight_shared_tokens: int = 0
    # how long the oldest request routed here by this router and still awaiting its first token
    # has waited, in ms at decision time (0: none): a replica whose queue does not move shows it
    pending_age_ms: float = 0.0
    # of in_flight_tokens, the expected outputs not decoded yet (FlightCounters.unproduced_tokens):
    # the KV those requests hold now is in_flight_tokens - in_flight_shared_tokens - this; 0: unknown
    in_flight_unproduced_tokens: int = 0
    # of matched_blocks, the leading ones a request in flight there holds (its prompt leads with
    # them): the engine holds them once; counted only when the KV could be short (else 0)
    pinned_blocks: int = 0
    # this router's flights there, for kv_aware's room soonest: worked out only when the
    # request may not fit beside them (else None; FlightCounters.room_schedule)
    room_schedule: RoomSchedule | None = None
    ttft: TtftParams | None = None  # the replica's fitted TTFT model (None: the policy's prior)

    @property
    def expected_blocks(self) -> int:
        """The matched blocks expected still cached when this request's prefill starts."""
        return self.matched_blocks - self.evicted_blocks


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    replicas: tuple[ReplicaState, ...]

    def healthy(self) -> list[ReplicaState]:
        return [r for r in self.replicas if r.healthy]


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    reason: str
    matched_blocks: int = 0
    scores: Mapping[str, float] = field(default_factory=dict)
    # per replica, the named terms of its score (kv_aware: its cost; with rule: ms also the
    # predicted TTFT ms and its parts)
    terms: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


class NoReplicaError(Exception):
    """No healthy replica can take the request."""


class Policy(Protocol):
    name: str

    def choose(self, request: RequestFeatures, fleet: FleetSnapshot) -> Decision:
        """The decision for ``request`` (raises ``NoReplicaError``); never changes the policy."""
        ...

    def commit(self, decision: Decision) -> None:
        """``decision`` (from this policy's ``choose``) was used: advance the private state."""
        ...


def require_healthy(fleet: FleetSnapshot) -> list[ReplicaState]:
    healthy = fleet.healthy()
    if not healthy:
        raise NoReplicaError("no healthy replica")
    return healthy


def load_of(r: ReplicaState) -> int:
    """Requests ahead of a new one on this replica: what the gateway routed there, or what the
    engine reports when that is larger (other gateways, or clients bypassing this one)."""
    return max(r.in_flight_requests, r.engine_running + r.engine_waiting)
