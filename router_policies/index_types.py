"""The prefix index's configuration, errors and match result (docs/architecture.md, "Prefix
index"); ``router_policies.prefix_index`` re-exports them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class IndexConfig(BaseModel):
    """Bounds and weights of the prefix index."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_blocks_per_replica: int = Field(500_000, gt=0, description="Precise blocks one replica may hold.")
    max_total_blocks: int = Field(
        20_000_000, gt=0, description="Precise plus approximate entries over all replicas."
    )
    approximate_blocks_per_replica: int = Field(
        50_000, ge=0, description="Approximate (routing-decision) entries kept per replica."
    )
    approximate_ttl_s: float = Field(120.0, gt=0, description="Lifetime of an untouched approximate entry.")
    medium_weights: dict[str, float] = Field(
        default_factory=lambda: {"GPU": 1.0, "CPU": 0.75},
        description="Weight of a matched block by the medium that holds it (unknown media weigh 1.0).",
    )
    max_replicas: int = Field(1024, gt=0, description="Replicas the index tracks at once.")


class IndexBoundError(Exception):
    """A mutation would exceed a configured bound; the index is unchanged."""


class UnknownReplicaError(IndexBoundError):
    """A mutation names a replica the index does not track (only ``add_replica`` adds one); the
    index is unchanged. An ``IndexBoundError``, so every caller's "refused, nothing changed"
    handling covers it."""


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Per replica, the number of leading request blocks it holds and their medium-weighted sum."""

    blocks: Mapping[str, int]
    scores: Mapping[str, float]


def check_replica_bound(config: IndexConfig, blocks: int, what: str) -> None:
    """Raise ``IndexBoundError`` when ``blocks`` precise entries of one replica exceed its bound;
    ``what`` starts the message (``"replica 'r0' would hold"``, ``"snapshot of 'r0' has"``)."""
    if blocks > config.max_blocks_per_replica:
        raise IndexBoundError(
            f"{what} {blocks} blocks, over max_blocks_per_replica={config.max_blocks_per_replica}"
        )


def check_total_bound(config: IndexConfig, entries: int) -> None:
    """Raise ``IndexBoundError`` when the index would hold more than ``max_total_blocks``."""
    if entries > config.max_total_blocks:
        raise IndexBoundError(f"index would exceed max_total_blocks={config.max_total_blocks}")
