"""The prediction audit: compare the cached prompt tokens the gateway predicted for the replica it
chose with what the engine reports in ``usage.prompt_tokens_details.cached_tokens``.

The response bytes are only read, never changed: a non-streaming body is parsed after it was
received in full; for a stream, a bounded tail of the bytes is kept and the last ``data:`` event
carrying ``usage`` (sent when the client asked for ``stream_options.include_usage``) is parsed at
the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import orjson

from gateway.features.segment_encoder import TokenArray
from gateway.metrics import GatewayMetrics
from gateway.replica_record import ReplicaRecord

T = TypeVar("T")

SSE_TAIL_BYTES = 64 * 1024  # the usage event is the last or second-to-last event of a stream


class SseTail:
    """The last bytes of a stream: at most ``2 * limit`` held, at least the last ``limit`` kept."""

    __slots__ = ("_buf", "_limit")

    def __init__(self, first: bytes, limit: int = SSE_TAIL_BYTES) -> None:
        self._limit = limit
        self._buf = bytearray(first[-limit:])

    def feed(self, chunk: bytes) -> None:
        buf = self._buf
        buf += chunk
        if len(buf) > 2 * self._limit:  # trimmed in batches, not on every chunk
            del buf[: -self._limit]

    def __len__(self) -> int:
        return len(self._buf)

    def value(self) -> bytes:
        return bytes(self._buf)


def cached_tokens_of(doc: Any) -> int | None:
    if not isinstance(doc, dict):
        return None
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def cached_tokens_in_body(body: bytes) -> int | None:
    try:
        return cached_tokens_of(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None


def last_in_sse_tail(tail: bytes, read: Callable[[Any], T | None]) -> T | None:
    """``read`` of the last event carrying ``usage`` in the tail of an SSE stream that gives a value."""
    for event in reversed(tail.replace(b"\r\n", b"\n").split(b"\n\n")):
        if b'"usage"' not in event:
            continue
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    found = read(orjson.loads(line[5:].strip()))
                except orjson.JSONDecodeError:
                    continue
                if found is not None:
                    return found
    return None


def cached_tokens_in_sse_tail(tail: bytes) -> int | None:
    """The cached tokens of the last event carrying usage in the tail of an SSE stream."""
    return last_in_sse_tail(tail, cached_tokens_of)


def record_audit(metrics: GatewayMetrics, record: ReplicaRecord, predicted: int, reported: int) -> None:
    """Count one audited request in the replica's statistics (their only writer) and metrics."""
    outcome = record.audit.record(predicted, reported)
    metrics.audit_by(record.id, outcome).inc()
    metrics.audit_error_by(record.id).observe(predicted - reported)


def held_prefix_hint(
    keys: Sequence[int], token_ids: TokenArray | None, block_size: int, reported: int
) -> tuple[list[int], list[int]] | None:
    """What the engine's report tells a recovering agent (docs/agent.md, "Recovery without
    replay"): it holds the request's first ``reported // block_size`` keys, and the first block it
    stored for the request (the tokens returned) is their child. None when nothing was cached,
    or nothing new was stored, or the tokens are unknown."""
    n = reported // block_size
    if token_ids is None or n <= 0 or n >= len(keys) or len(token_ids) < (n + 1) * block_size:
        return None
    next_tokens: list[int] = token_ids[n * block_size : (n + 1) * block_size].tolist()
    return list(keys[:n]), next_tokens
