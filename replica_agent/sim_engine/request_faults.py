"""Per-request faults of the simulated engine, for tests of what a proxy in front of it must
survive (issue 13: a hung, slow or failing engine, corrupt payloads). Set through
``POST /debug/faults`` beside the KV-event faults (kv_events.py).

Each count applies to the next N generation requests (``/v1/completions``,
``/v1/chat/completions``), in arrival order; a request takes the first fault with a count left,
in the order of ``KINDS``:

- ``error``: answered with ``error_status`` (default 500) and vLLM's error JSON, nothing generated;
- ``hang``: never answered (no header, no byte) until the client goes away;
- ``slow``: waits ``slow_ms`` before it is served (a slow first byte);
- ``corrupt``: answered 200 with a body that is not the JSON (or SSE) it claims to be;
- ``stall``: a stream that sends its first event, then nothing until the client goes away (a
  non-streaming request stalls before its answer, as ``hang``).

Owned by the HTTP routes, touched only on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KINDS = ("error", "hang", "slow", "corrupt", "stall")
SETTINGS = ("error_status", "slow_ms")
MAX_COUNT = 1_000_000
ERROR_STATUSES = (500, 502, 503, 504)


class FaultFieldError(ValueError):
    """A bad ``/debug/faults`` field; ``field`` names it."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.field = name


def _int_in(body: dict[str, Any], name: str, lo: int, hi: int, default: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FaultFieldError(f"'{name}' must be an integer in [{lo}, {hi}]", name)
    return value


@dataclass(slots=True)
class RequestFaults:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    error_status: int = 500
    slow_ms: int = 1000
    applied: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    @staticmethod
    def fields() -> frozenset[str]:
        return frozenset((*KINDS, *SETTINGS))

    @staticmethod
    def mentioned(body: dict[str, Any]) -> bool:
        return any(k in body for k in (*KINDS, *SETTINGS))

    def set(self, body: dict[str, Any]) -> None:
        """Replace the counts and settings from ``body`` (absent counts become 0); raises
        ``FaultFieldError`` before changing anything."""
        counts = {k: _int_in(body, k, 0, MAX_COUNT, 0) for k in KINDS}
        status = _int_in(body, "error_status", 400, 599, self.error_status)
        if status not in ERROR_STATUSES:
            raise FaultFieldError(f"'error_status' must be one of {list(ERROR_STATUSES)}", "error_status")
        slow_ms = _int_in(body, "slow_ms", 0, 600_000, self.slow_ms)
        self.counts, self.error_status, self.slow_ms = counts, status, slow_ms

    def take(self) -> str | None:
        """The fault of the next request (its count goes down by one), or None."""
        for kind in KINDS:
            if self.counts[kind] > 0:
                self.counts[kind] -= 1
                self.applied[kind] += 1
                return kind
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.counts,
            "error_status": self.error_status,
            "slow_ms": self.slow_ms,
            "applied": dict(self.applied),
        }
