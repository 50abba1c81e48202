"""round_robin: each healthy replica in turn, ignoring cache and load."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from router_policies.policy import Decision, FleetSnapshot, RequestFeatures, require_healthy


class RoundRobinParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoundRobin:
    name = "round_robin"

    def __init__(self, params: RoundRobinParams, seed: int = 0) -> None:
        self._cursor = seed

    def commit(self, decision: Decision) -> None:  # placeholder until W1/W6 split choose/commit
        pass

    def choose(self, request: RequestFeatures, fleet: FleetSnapshot) -> Decision:
        healthy = require_healthy(fleet)
        r = healthy[self._cursor % len(healthy)]
        self._cursor += 1
        return Decision(replica=r.id, reason="round_robin", matched_blocks=r.matched_blocks)
