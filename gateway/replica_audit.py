"""A replica's prediction-audit statistics (docs/architecture.md, "Prediction audit"):
how often the cached tokens the gateway predicted equal what the engine reported.
``AuditStats.record`` is their only writer (called by ``gateway.prediction_audit.record_audit``).
"""

from __future__ import annotations


class AuditStats:
    __slots__ = ("exact", "total")

    def __init__(self) -> None:
        self.total = 0
        self.exact = 0

    def record(self, predicted: int, reported: int) -> str:
        """Count one audited request; returns its outcome: exact, over or under."""
        self.total += 1
        if predicted == reported:
            self.exact += 1
            return "exact"
        return "over" if predicted > reported else "under"

    @property
    def exact_fraction(self) -> float | None:
        return self.exact / self.total if self.total else None
