"""least_loaded: the healthy replica with the fewest requests ahead (in flight through this
gateway, or running plus waiting in the engine, whichever is larger), then the fewest in-flight
tokens; remaining ties rotate so that an idle fleet still spreads."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from router_policies.policy import Decision, FleetSnapshot, RequestFeatures, load_of, require_healthy


class LeastLoadedParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LeastLoaded:
    name = "least_loaded"

    def __init__(self, params: LeastLoadedParams, seed: int = 0) -> None:
        self._cursor = seed

    def commit(self, decision: Decision) -> None:  # placeholder until W1/W6 split choose/commit
        pass

    def choose(self, request: RequestFeatures, fleet: FleetSnapshot) -> Decision:
        healthy = require_healthy(fleet)
        n = len(healthy)
        start = self._cursor % n
        self._cursor += 1
        rotated = healthy[start:] + healthy[:start]
        best = min(rotated, key=lambda r: (load_of(r), r.in_flight_tokens))
        return Decision(
            replica=best.id,
            reason="least_loaded",
            matched_blocks=best.matched_blocks,
            scores={r.id: float(load_of(r)) for r in healthy},
        )
