"""Reference policies for experiments (not shipped): load them as ``module:attr`` with
``PYTHONPATH=tests/sim kvgate compare --policies reference_policies:LongestMatch``.

``LongestMatch`` is pure locality: the replica holding the longest leading run of the request's
blocks (at least ``min_blocks``), ties and shorter matches to the least loaded one. It ignores
queues, so it shows how much hit rate a policy can keep on a trace at all, and what ignoring load
costs in TTFT (docs/simulator.md)."""

from __future__ import annotations

from pydantic import Field

from router_policies.policies.rotation import NoParams, Rotating
from router_policies.policy import Decision, FleetSnapshot, RequestFeatures, load_of, require_healthy


class LongestMatchParams(NoParams):
    min_blocks: int = Field(2, ge=1, description="Shorter matches count as no match.")


class LongestMatch(Rotating):
    """The cursor advances on ``commit`` (``choose`` is pure)."""

    Params = LongestMatchParams
    name = "longest_match"

    def __init__(self, params: LongestMatchParams, seed: int = 0) -> None:
        super().__init__(params, seed)
        self.params = params

    def choose(self, _request: RequestFeatures, fleet: FleetSnapshot) -> Decision:
        rotated = self.rotated(require_healthy(fleet))
        best = max(r.matched_blocks for r in rotated)
        cands = (
            [r for r in rotated if r.matched_blocks == best] if best >= self.params.min_blocks else rotated
        )
        pick = min(cands, key=lambda r: (load_of(r), r.pending_prefill_tokens))
        return Decision(pick.id, "longest_match", pick.matched_blocks)
