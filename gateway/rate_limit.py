"""Per-key request rate limits on the OpenAI API: one token bucket per API key (docs/gateway.md,
"API keys and rate limits").

Invariants
* Memory is bounded: one bucket per configured key at most (``max_keys``, the number of keys
  loaded); a key is never tracked unless it was authenticated first.
* A bucket holds at most ``burst`` tokens and refills at ``rate`` per second; a request takes one
  token or is refused with the time until the next token, and a refusal takes nothing.
* Deterministic: time comes from the injected monotonic clock only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float


class TokenBuckets:
    """``rate`` requests per second sustained, ``burst`` at once, per key (``rate`` > 0)."""

    def __init__(
        self, rate: float, burst: int, max_keys: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or burst < 1 or max_keys < 1:
            raise ValueError("rate > 0, burst >= 1 and max_keys >= 1")
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> float:
        """Take one token of ``key``'s bucket: 0.0 when allowed, else the seconds until one is
        available (nothing taken)."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                raise RuntimeError(f"more than max_keys={self.max_keys} keys rate-limited")
            bucket = self._buckets[key] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.stamp) * self.rate)
        bucket.stamp = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate
