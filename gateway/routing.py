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

import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.features import Featurizer
from gateway.fleet import Fleet, ReplicaRecord
from router_policies.policy import Decision, FleetSnapshot, Policy, RequestFeatures
from router_policies.prefix_index import MatchResult, PrefixIndex

TOUCH_REFRESH_S = 1.0  # a speculative chain's stamps are refreshed at most this often


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
    matched_blocks: int  # leading blocks of the prompt the index says the replica holds


@dataclass(slots=True)
class Speculation:
    """The speculative entries one committed attempt recorded (written only by ``Router``)."""

    state: RoutingState
    replica: str
    held_blocks: int  # leading blocks the replica held before: never undone
    keys: Sequence[int] = ()  # the longest key chain recorded
    undone: bool = False


def predicted_cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """What the engine will report as cached for ``matched_blocks`` leading blocks.

    vLLM always computes at least the prompt's last token (its cache-hit length is capped at
    ``prompt_tokens - 1``), so a fully cached prompt whose length is a multiple of the block size
    reports one block less."""
    if prompt_tokens <= 0:
        return 0
    return min(matched_blocks, (prompt_tokens - 1) // block_size) * block_size


class Router:
    def __init__(self, index: PrefixIndex, fleet: Fleet) -> None:
        self._index = index
        self._fleet = fleet

    def match(self, features: RequestFeatures) -> MatchResult:
        return self._index.match(features.block_keys)

    def decide(
        self,
        state: RoutingState,
        features: RequestFeatures,
        match: MatchResult,
        exclude: frozenset[str] = frozenset(),
    ) -> Choice:
        """Pick a replica (raises ``NoReplicaError``). Pure: changes neither the index, the
        fleet nor the policy (``/admin/explain`` calls it on the live policy)."""
        candidates = self._fleet.candidates(features.model)
        snap = self._fleet.snapshot(candidates, match.blocks, match.scores, exclude)
        decision = state.policy.choose(features, snap)
        record = self._fleet.get(decision.replica)
        assert record is not None  # the snapshot only holds fleet records
        matched = match.blocks.get(decision.replica, 0)
        predicted = predicted_cached_tokens(matched, features.prompt_tokens, features.block_size)
        return Choice(decision, record, snap, predicted, matched)

    def commit(self, state: RoutingState, features: RequestFeatures, choice: Choice) -> Speculation:
        """The request is sent to ``choice``'s replica: advance the policy and record the
        speculative entries (undone by ``undo`` if it is retried elsewhere)."""
        state.policy.commit(choice.decision)
        spec = Speculation(state, choice.decision.replica, choice.matched_blocks)
        self.record(spec, features.block_keys)
        return spec

    def record(self, spec: Speculation, keys: Sequence[int]) -> None:
        """Record ``keys`` as ``spec``'s replica's speculative entries (the commit's, or the full
        keys of its deferred encode); nothing once undone."""
        if spec.undone or not keys:
            return
        if len(keys) > len(spec.keys):
            spec.keys = keys
        self.touch(spec.state, spec.replica, keys)

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
        self,
        state: RoutingState,
        features: RequestFeatures,
        match: MatchResult,
        exclude: frozenset[str] = frozenset(),
        explain: bool = False,
    ) -> Choice:
        """``decide`` then, unless ``explain``, ``commit`` (the pre-split call, kept for callers
        that route without retries)."""
        choice = self.decide(state, features, match, exclude)
        if not explain:
            self.commit(state, features, choice)
        return choice

    def touch(self, state: RoutingState, replica: str, keys: Sequence[int]) -> None:
        """Record the speculative entries of a request routed to ``replica`` with ``keys`` (the
        speculative-touch rule: lifetime with/without agent, refreshed at most once a second)."""
        if self._fleet.get(replica) is None:
            return  # left the fleet since (a deferred encode finishing late)
        now = time.monotonic()
        idx_cfg = self._index.config
        if self._fleet.has_agent(replica):
            # The engine's own events will follow within moments; the entry only bridges that
            # gap, so it is back-dated to expire after proxy.speculative_ttl_s instead of the
            # index's approximate_ttl_s (one replica's entries keep a consistent age offset, so
            # the index's oldest-first expiry order holds).
            now -= max(0.0, idx_cfg.approximate_ttl_s - state.config.proxy.speculative_ttl_s)
        cap = idx_cfg.approximate_blocks_per_replica
        if not keys or not cap:
            return
        # A touch stamps a prompt's blocks leaf to root, so a leaf stamped since the last refresh
        # means the whole chain was; one held precisely means the engine's events arrived. Either
        # way re-touching would only move the chain's stamps by less than TOUCH_REFRESH_S (a
        # hot prefix is touched by every request: this was ~10% of the event loop).
        if self._index.holds_since(replica, keys[min(len(keys), cap) - 1], now - TOUCH_REFRESH_S):
            return
        self._index.touch_approximate(replica, keys, now)
