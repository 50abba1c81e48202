"""The decision for one request: index match -> immutable fleet snapshot -> policy -> speculative
index entry.

``RoutingState`` is everything a reload can change (config, policy, featurizer); the app swaps
the whole object in one assignment, and a request reads it once at its start, so a request never
mixes two configs.

Everything here is synchronous: the index and fleet are mutated without an await in between, so
each decision is atomic on the event loop.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.features import Featurizer
from gateway.fleet import Fleet, ReplicaRecord
from router_policies.placement import TOUCH_REFRESH_S, predicted_cached_tokens
from router_policies.policy import Decision, FleetSnapshot, Policy, RequestFeatures
from router_policies.prefix_index import MatchResult, PrefixIndex

__all__ = ["TOUCH_REFRESH_S", "Choice", "Router", "RoutingState", "predicted_cached_tokens"]


@dataclass(frozen=True, slots=True)
class RoutingState:
    config: GatewayConfig
    policy: Policy
    featurizer: Featurizer


@dataclass(frozen=True, slots=True)
class Choice:
    decision: Decision
    record: ReplicaRecord
    snapshot: FleetSnapshot
    predicted_tokens: int  # cached prompt tokens the engine should report on this replica


class Router:
    def __init__(self, index: PrefixIndex, fleet: Fleet) -> None:
        self._index = index
        self._fleet = fleet

    def match(self, features: RequestFeatures) -> MatchResult:
        return self._index.match(features.block_keys)

    def choose(
        self,
        state: RoutingState,
        features: RequestFeatures,
        match: MatchResult,
        exclude: frozenset[str] = frozenset(),
        explain: bool = False,
    ) -> Choice:
        """Pick a replica (raises ``NoReplicaError``). Unless ``explain``, records the speculative
        index entry; ``explain`` runs a copy of the policy so the live one's state is untouched."""
        candidates = self._fleet.candidates(features.model)
        snap = self._fleet.snapshot(candidates, match.blocks, match.scores, exclude)
        policy = copy.deepcopy(state.policy) if explain else state.policy
        decision = policy.choose(features, snap)
        record = self._fleet.get(decision.replica)
        assert record is not None  # the snapshot only holds fleet records
        matched = match.blocks.get(decision.replica, 0)
        predicted = predicted_cached_tokens(matched, features.prompt_tokens, features.block_size)
        if not explain and features.block_keys:
            self.touch(state, decision.replica, features.block_keys)
        return Choice(decision, record, snap, predicted)

    def touch(self, state: RoutingState, replica: str, keys: Sequence[int]) -> None:
        """Record the speculative entries of a request routed to ``replica`` with ``keys``
        (the placement rule: ``router_policies.placement.speculative_touch``, through the fleet
        for whether an agent reports the replica and for the clock)."""
        self._fleet.touch(replica, keys, state.config.proxy.speculative_ttl_s)
