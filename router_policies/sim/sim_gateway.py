"""The simulated gateway's decision path (docs/architecture.md, "Placement"; docs/simulator.md):
the gateway's own placement code (``router_policies.placement``) over a ``PrefixIndex``, for
replicas whose agents report their blocks, on virtual time.

Per request, in the gateway's order: index match, ``FleetSnapshot`` (``placement.snapshot``),
``policy.choose`` then ``policy.commit``, the speculative entry (``placement.speculative_touch``
with the lifetime of a replica with an agent, ``TouchRule``), the predicted cached tokens and a
``Flight`` whose pending prefill follows ``predicted_cached_tokens``' rule, started by the TTFT
model's feed (``placement.TtftFeed``, as the gateway's ``Fleet`` does): the caller passes the
virtual time of the first token to ``Flight.first_byte``, which fits the replica's model, and
the snapshot carries every replica's fitted model. Expired speculative
entries are swept every ``placement.EXPIRE_INTERVAL_S`` of virtual time, as the gateway's
housekeeping loop does. ``tests/integration/test_sim_gateway_parity.py`` checks this path and the
gateway's ``Router`` + ``Fleet`` make the same decisions and leave the same index.

Invariant: this object is the simulated fleet, the only owner of the index's replica set (it
adds every replica once, at construction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from router_policies import placement
from router_policies.placement import (
    Candidate,
    Dispatch,
    ExpirySweep,
    Flight,
    FlightCounters,
    IndexView,
    ReplicaLoad,
    TouchRule,
    TtftFeed,
)
from router_policies.policy import Decision, FleetSnapshot, Policy, RequestFeatures
from router_policies.prefix_index import PrefixIndex

# (running, waiting, KV usage) of replica i, as its agent reports them
EngineLoadFn = Callable[[int], tuple[int, int, float]]


@dataclass(frozen=True, slots=True)
class Routed:
    decision: Decision
    replica: int  # index of decision.replica in the fleet
    snapshot: FleetSnapshot
    predicted_tokens: int
    flight: Flight


class SimGateway:
    def __init__(
        self,
        replicas: Sequence[str],
        policy: Policy,
        index: PrefixIndex,
        engine_load: EngineLoadFn,
        touch: TouchRule | None = None,
        ttft: TtftFeed | None = None,
    ) -> None:
        self.names = list(replicas)
        self.ttft = ttft if ttft is not None else TtftFeed()
        self.index = index
        self._policy = policy
        self._engine_load = engine_load
        self._touch = touch or TouchRule()
        self._slot = {name: i for i, name in enumerate(self.names)}
        for name in self.names:
            index.add_replica(name)
        self._flights = [FlightCounters() for _ in self.names]
        self._sweep = ExpirySweep(index)

    def advance(self, now: float) -> None:
        """Virtual time reached ``now``: run the housekeeping sweep due by then."""
        self._sweep.advance(now)

    # the engine's events, as its agent reports them
    def stored(self, replica: str, keys: Sequence[int], now: float) -> None:
        self.advance(now)
        self.index.store(replica, keys)

    def removed(self, replica: str, keys: Sequence[int], now: float) -> None:
        self.advance(now)
        self.index.remove(replica, keys)

    def cleared(self, replica: str, now: float) -> None:
        self.advance(now)
        self.index.clear_replica(replica)

    def _candidates(self, now: float) -> list[Candidate]:
        out = []
        for i, name in enumerate(self.names):
            running, waiting, kv_usage = self._engine_load(i)
            f = self._flights[i]
            load = ReplicaLoad(f.requests, f.tokens, f.pending_prefill_tokens, running, waiting, kv_usage)
            age = f.pending_age_ms(now)
            out.append(
                Candidate(
                    name,
                    True,
                    load,
                    f.pending_prefill_pairs,
                    f.shared_tokens,
                    age,
                    f.prompt_keys(),
                    f.unproduced_tokens(now),
                    partial(f.room_schedule, now),
                )
            )
        return out

    def route(
        self, features: RequestFeatures, output_tokens: int, now: float, keys: Sequence[int] | None = None
    ) -> Routed:
        """Decide and commit one request arriving at ``now``; its flight is the caller's to end.
        ``keys``: ``features.block_keys`` as a uint64 array, when the caller has one (the index
        takes it without a copy)."""
        self.advance(now)
        index = self.index
        if keys is None:
            keys = features.block_keys
        m = index.match(keys)
        view = IndexView(m.blocks, m.scores, index, keys, features.block_size, features.prompt_tokens)
        snap = placement.snapshot(self._candidates(now), view, ttft=self.ttft.params)
        decision = self._policy.choose(features, snap)
        self._policy.commit(decision)
        name = decision.replica
        lifetime = self._touch.lifetime_s(index, has_agent=True)
        placement.speculative_touch(index, name, keys, now, lifetime)
        chosen, predicted = placement.chosen_prediction(snap, name, features)
        ri = self._slot[name]
        dispatch = Dispatch.of(chosen, features, predicted, output_tokens)
        flight = self.ttft.flight(self._flights[ri], dispatch, now)
        return Routed(decision, ri, snap, predicted, flight)
