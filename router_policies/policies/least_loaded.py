"""least_loaded: the healthy replica with the fewest requests ahead (in flight through this
gateway, or running plus waiting in the engine, whichever is larger), then the fewest in-flight
tokens; remaining ties rotate so that an idle fleet still spreads (the rotation advances on
``commit``)."""

from __future__ import annotations

from router_policies.policies.rotation import NoParams, Rotating
from router_policies.policy import Decision, FleetSnapshot, RequestFeatures, load_of, require_healthy


class LeastLoadedParams(NoParams):
    """least_loaded takes no parameters."""


class LeastLoaded(Rotating):
    name = "least_loaded"

    def choose(self, _request: RequestFeatures, fleet: FleetSnapshot) -> Decision:
        healthy = require_healthy(fleet)
        best = min(self.rotated(healthy), key=lambda r: (load_of(r), r.in_flight_tokens))
        return Decision(
            replica=best.id,
            reason="least_loaded",
            matched_blocks=best.matched_blocks,
            scores={r.id: float(load_of(r)) for r in healthy},
        )
