"""round_robin: each healthy replica in turn, ignoring cache and load (the cursor advances on
``commit``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from router_policies.policy import Decision, FleetSnapshot, RequestFeatures, require_healthy


class RoundRobinParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoundRobin:
    name = "round_robin"

    def __init__(self, _params: RoundRobinParams, seed: int = 0) -> None:
        self._cursor = seed

    def choose(self, _request: RequestFeatures, fleet: FleetSnapshot) -> Decision:
        healthy = require_healthy(fleet)
        r = healthy[self._cursor % len(healthy)]
        return Decision(replica=r.id, reason="round_robin", matched_blocks=r.matched_blocks)

    def commit(self, _decision: Decision) -> None:
        self._cursor += 1
