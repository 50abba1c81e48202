"""What the policies that rotate their ties share (docs/architecture.md, "Policies"): a cursor over
the healthy replicas that ``commit`` advances once per decision used, so that ``choose`` stays
pure and an idle fleet still spreads; and the parameter model of a policy that takes none."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from router_policies.policy import Decision, ReplicaState


class NoParams(BaseModel):
    """A policy without parameters (any given is refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Rotating:
    """Base of a policy built as ``(params, seed)`` that rotates its ties from ``seed`` on."""

    def __init__(self, _params: BaseModel, seed: int = 0) -> None:
        self._cursor = seed

    def rotated(self, healthy: list[ReplicaState]) -> list[ReplicaState]:
        """``healthy`` starting at the cursor (``healthy`` is not empty)."""
        start = self._cursor % len(healthy)
        return healthy[start:] + healthy[:start]

    def commit(self, _decision: Decision) -> None:
        self._cursor += 1
