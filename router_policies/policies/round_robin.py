"""round_robin: each healthy replica in turn, ignoring cache and load (the cursor advances on
``commit``)."""

from __future__ import annotations

from router_policies.policies.rotation import NoParams, Rotating
from router_policies.policy import Decision, FleetSnapshot, RequestFeatures, require_healthy


class RoundRobinParams(NoParams):
    """round_robin takes no parameters."""


class RoundRobin(Rotating):
    name = "round_robin"

    def choose(self, _request: RequestFeatures, fleet: FleetSnapshot) -> Decision:
        r = self.rotated(require_healthy(fleet))[0]
        return Decision(replica=r.id, reason="round_robin", matched_blocks=r.matched_blocks)
