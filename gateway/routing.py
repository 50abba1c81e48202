"""The decision for one request (docs/architecture.md, "Request path"): index match -> immutable
fleet snapshot -> policy (``Router.decide``, pure), then, once the proxy sends the request,
``Router.commit``: the policy's commit and the speculative index entry, in one place.

The router is the one writer of speculative entries: ``commit`` records the prompt's keys,
``record`` adds the keys of a deferred encode finishing later (through the same touch), and
``undo`` removes what an attempt added when the request is retried on another replica (the
leading blocks the replica already held before stay: they were not this attempt's).

``RoutingState`` is everything a reload can change (config, policy, featurizer); the app swaps
the whole object in one assignment, and a request reads it once at its start, so a request never
mixes two configs.

Everything here is synchronous: the index and fleet are mutated without an await in between, so
each decision is atomic on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.features import Featurizer
from gateway.fleet import Fleet, ReplicaRecord
from router_policies.placement import chosen_prediction
from router_policies.policy import Decision, FleetSnapshot, Policy, ReplicaState, RequestFeatures
from router_policies.prefix_index import MatchResult, PrefixIndex

__all__ = ["Choice", "Router", "RoutingState"]


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
    state: ReplicaState  # the replica as the decision saw it (its matched and expected blocks)


@dataclass(slots=True)
class Speculation:
    """The speculative entries one committed attempt recorded (written only by ``Router``)."""

    replica: str
    held_blocks: int  # leading blocks the replica held before: never undone
    keys: Sequence[int] = ()  # the longest key chain recorded
    undone: bool = False


class Router:
    def __init__(self, index: PrefixIndex, fleet: Fleet) -> None:
        self._index = index
        self._fleet = fleet

    def match(self, features: RequestFeatures) -> MatchResult:
        """The index's match; hybrid replicas' deepest key within the blocks the engine can reuse
        (never the block of the prompt's last token: ``predicted_cached_tokens``)."""
        bound = (features.prompt_tokens - 1) // features.block_size if features.prompt_tokens > 0 else None
        return self._index.match(features.block_keys, bound)

    def decide(
        self,
        state: RoutingState,
        features: RequestFeatures,
        match: MatchResult,
        exclude: frozenset[str] = frozenset(),
    ) -> Choice:
        """Pick a replica (raises ``NoReplicaError``). Pure: changes neither the index, the
        fleet nor the policy (``/admin/explain`` calls it on the live policy)."""
        candidates = self._fleet.candidates(features.model, features.lora, exclude)
        snap = self._fleet.snapshot(candidates, features, match, exclude)
        decision = state.policy.choose(features, snap)
        record = self._fleet.get(decision.replica)
        assert record is not None  # the snapshot only holds fleet records
        chosen, predicted = chosen_prediction(snap, decision.replica, features)
        return Choice(decision, record, snap, predicted, chosen)

    def commit(self, state: RoutingState, features: RequestFeatures, choice: Choice) -> Speculation:
        """The request is sent to ``choice``'s replica: advance the policy and record the
        speculative entries (undone by ``undo`` if it is retried elsewhere)."""
        state.policy.commit(choice.decision)
        spec = Speculation(choice.decision.replica, choice.state.matched_blocks)
        self.record(spec, features.block_keys)
        return spec

    def record(self, spec: Speculation, keys: Sequence[int]) -> None:
        """Record ``keys`` as ``spec``'s replica's speculative entries (the commit's, or the full
        keys of its deferred encode); nothing once undone."""
        if spec.undone or not keys:
            return
        if len(keys) > len(spec.keys):
            spec.keys = keys
        self.touch(spec.replica, keys)

    def undo(self, spec: Speculation) -> None:
        """The attempt failed and the request goes elsewhere: drop the entries it added (the keys
        past the leading blocks the replica held at decision time). A request routed to the same
        replica with the same new blocks in between shares them and loses them too: it then
        matches less there, never wrongly."""
        spec.undone = True
        added = spec.keys[spec.held_blocks :]
        if len(added):
            self._index.forget_approximate(spec.replica, added)

    def choose(
        self, state: RoutingState, features: RequestFeatures, exclude: frozenset[str] = frozenset()
    ) -> Choice:
        """``match``, ``decide`` and ``commit`` in one call (used by tests, benches and the
        simulator parity check, which route without retries)."""
        choice = self.decide(state, features, self.match(features), exclude)
        self.commit(state, features, choice)
        return choice

    def touch(self, replica: str, keys: Sequence[int]) -> None:
        """Record the speculative entries of a request routed to ``replica`` with ``keys``
        (the placement rule: ``router_policies.placement.speculative_touch``, through the fleet
        for whether an agent reports the replica and for the clock)."""
        self._fleet.touch(replica, keys)
