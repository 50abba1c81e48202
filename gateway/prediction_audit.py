"""The prediction audit: compare the cached prompt tokens the gateway predicted for the replica it
chose with what the engine reports in ``usage.prompt_tokens_details.cached_tokens``.

The response bytes are only read, never changed: a non-streaming body is parsed after it was
received in full; for a stream, a bounded tail of the bytes is kept and the last ``data:`` event
carrying ``usage`` (sent when the client asked for ``stream_options.include_usage``) is parsed at
the end.

Every inexact prediction is explained by one cause (``inexact_cause``), from what the index said
at dispatch (``placement.IndexAtDispatch``) and says at the audit. With P the predicted and R the
reported cached blocks:

* over-predicted (P > R), block R, the first the engine did not have:
  - ``concurrent_not_stored``: it was only a speculative entry at dispatch (a request routed
    there before had not had its blocks stored and reported by the engine yet);
  - ``evicted``: it was reported by the engine, and the engine has reported removals on the
    replica since the dispatch (blocks evicted between the decision and the prefill);
  - ``stale_index``: it was reported by the engine and no removal was reported since: the index
    held an entry the engine no longer had (a removal lost or not sent);
* under-predicted (P < R): the engine had blocks the index did not credit:
  - ``not_yet_reported``: the index holds the blocks up to R precisely now (stored by a
    concurrent request, their events still on the way at the decision);
  - ``tokenization``: it still does not: the engine's tokens are not the gateway's (another chat
    template or tokenizer), so its blocks never carry the request's keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from gateway.features.segment_encoder import TokenArray
from gateway.metrics import GatewayMetrics
from gateway.replica_record import ReplicaRecord
from router_policies.placement import IndexAtDispatch
from router_policies.prefix_index import PrefixIndex

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


@dataclass(frozen=True, slots=True)
class AuditCase:
    """One audited attempt: its request's block keys and block size, the cached tokens
    predicted and reported, and what the index said at dispatch."""

    keys: Sequence[int]
    block_size: int
    predicted: int
    reported: int
    at_dispatch: IndexAtDispatch


def inexact_cause(index: PrefixIndex, replica: str, case: AuditCase) -> str:
    """The cause of an inexact prediction (module docstring); ``predicted != reported``."""
    bs = max(1, case.block_size)
    at = case.at_dispatch
    if case.predicted > case.reported:
        first_missing = case.reported // bs
        if at.precise_blocks <= first_missing:
            return "concurrent_not_stored"
        return "evicted" if index.removed_count(replica) > at.removed else "stale_index"
    had = min(len(case.keys), -(-case.reported // bs))
    return "not_yet_reported" if index.precise_run(replica, case.keys[:had]) >= had else "tokenization"


def record_audit(
    metrics: GatewayMetrics, record: ReplicaRecord, predicted: int, reported: int, cause: str | None = None
) -> None:
    """Count one audited request in the replica's statistics (their only writer) and metrics;
    ``cause``: why an inexact prediction was inexact (``inexact_cause``)."""
    outcome = record.audit.record(predicted, reported, cause)
    metrics.audit_by(record.id, outcome).inc()
    metrics.audit_error_by(record.id).observe(predicted - reported)
    if outcome != "exact":
        metrics.audit_cause_by(record.id, cause or "unknown").inc()


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
