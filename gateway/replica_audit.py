"""A replica's prediction-audit statistics (docs/architecture.md, "Prediction audit"):
how often the cached tokens the gateway predicted equal what the engine reported.
``AuditStats.record`` is their only writer (called by ``gateway.prediction_audit.record_audit``).
``TtftAuditStats``: the same for the TTFT model's predictions in milliseconds.
"""

from __future__ import annotations

import statistics
from collections import deque


class AuditStats:
    __slots__ = ("causes", "exact", "total")

    def __init__(self) -> None:
        self.total = 0
        self.exact = 0
        self.causes: dict[str, int] = {}  # inexact predictions by cause (a few fixed names)

    def record(self, predicted: int, reported: int, cause: str | None = None) -> str:
        """Count one audited request; returns its outcome: exact, over or under. An inexact one
        is counted under its ``cause`` (``prediction_audit.inexact_cause``), given iff inexact."""
        if (predicted == reported) != (cause is None):
            raise ValueError(
                f"a cause is given iff the prediction is inexact: {predicted}, {reported}, {cause}"
            )
        self.total += 1
        if cause is None:
            self.exact += 1
            return "exact"
        self.causes[cause] = self.causes.get(cause, 0) + 1
        return "over" if predicted > reported else "under"

    @property
    def exact_fraction(self) -> float | None:
        return self.exact / self.total if self.total else None


TTFT_WINDOW = 1024  # recent samples a replica's TTFT error quantiles are taken over (bounded)


class TtftAuditStats:
    """A replica's TTFT audit: the TTFT model's prediction at dispatch against the observed time
    to first byte. Only ``record`` writes it (the fleet's TTFT feed, at each first byte). Keeps
    the last ``TTFT_WINDOW`` relative errors (``TtftSample.relative_error``) for their median."""

    __slots__ = ("_errors", "total")

    def __init__(self) -> None:
        self.total = 0
        self._errors: deque[float] = deque(maxlen=TTFT_WINDOW)

    def record(self, relative_error: float) -> None:
        """Count one first token (its ``TtftSample.relative_error``)."""
        self.total += 1
        self._errors.append(relative_error)

    def median_abs_error(self) -> float | None:
        """Median absolute relative error over the window (None before any sample)."""
        if not self._errors:
            return None
        return float(statistics.median(abs(e) for e in self._errors))
