"""The prediction audit: compare the cached prompt tokens the gateway predicted for the replica it
chose with what the engine reports in ``usage.prompt_tokens_details.cached_tokens``
(docs/architecture.md, "Request path", step 8; docs/gateway.md, "Prediction audit").

The response bytes are only read, never changed: a non-streaming body is parsed after it was
received in full; for a stream, a bounded tail of the bytes is kept and the last ``data:`` event
carrying ``usage`` (sent when the client asked for ``stream_options.include_usage``) is parsed at
the end.

Every request the engine reports cached tokens for is audited, whatever its features were
(``AuditCase.kind``): ``exact`` (the engine's tokens), ``deferred`` (routed on the keys of its
encoded prefix, its trailing text encoded after routing: ``AttemptAudit`` takes the whole
prompt's keys once that encode is done, and the upstream waits for them, bounded, when an
inexact prediction's answer comes first) or ``approximate`` (character blocks).

Every inexact prediction is explained by one cause (``inexact_cause``), from what the index said
at dispatch (``placement.IndexAtDispatch``) and says at the audit, and from the prompt length the
engine reports against the gateway's (``AuditCase.tokens_agree``): the cause of the first block
where prediction and engine differ. With P the predicted and R the reported cached blocks:

* ``approximate_features``: the request was routed on character blocks (no tokenizer, or a
  failed remote ``/tokenize``): its keys are never the engine's and its prediction is an
  estimate in tokens, so no block-level cause applies;
* over-predicted (P > R), block R, the first the engine did not have:
  - ``concurrent_not_stored``: it was only a speculative entry at dispatch (a request routed
    there before had not had its blocks stored and reported by the engine yet);
  - ``evicted``: it was reported by the engine, and the engine has reported removals on the
    replica since the dispatch (blocks evicted between the decision and the prefill);
  - ``tokenization``: it was reported and nothing was removed since, but the engine counted
    another prompt length than the gateway (its blocks for this request are other tokens);
  - ``stale_index``: it was reported, no removal was reported since, and the prompt lengths do
    not differ: the index held an entry the engine no longer had (a removal lost or not sent);
* under-predicted (P < R): the engine had blocks the prediction did not credit, from block P:
  - ``eviction_estimate``: block P was one the index held and the prediction took as evicted
    before the prefill (the queue ahead filling the replica's cache,
    ``router_policies.cache_prediction.evicted_before_prefill``); the engine kept it;
  - ``deferred_encode``: block P lies past the keys the request was routed on (its text was
    encoded after routing): the gateway had no key for it at the decision; with the whole keys
    (when known) the index holds the engine's blocks or the engine's length fits them;
  - ``not_yet_reported``: the index holds the blocks up to R precisely now (their events were
    on the way at the decision), or it does not but the engine counted the prompt as the
    gateway did (so its blocks carry the request's keys: stored after the decision, evicted
    since), and the replica's agent does not say its inventory may miss blocks;
  - ``stale_index``: the same, with an agent that says its inventory may miss blocks (it lost
    engine events): the index lacked blocks the engine held;
  - ``tokenization``: the index does not hold them and the prompt lengths differ (or are not
    known), or the engine counted more blocks than the prompt has: the engine's tokens are not
    the gateway's (another chat template or tokenizer), so its blocks never carry the keys.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import orjson

from gateway.features.deferred_job import DeferredJob
from gateway.features.feature_info import FeatureInfo
from gateway.features.segment_encoder import TokenArray
from gateway.metrics import GatewayMetrics
from gateway.replica_record import ReplicaRecord
from router_policies.placement import IndexAtDispatch
from router_policies.policy import RequestFeatures
from router_policies.prefix_index import PrefixIndex

if TYPE_CHECKING:  # request_outcome imports this module
    from gateway.request_outcome import Usage

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


FeatureKind = Literal["exact", "deferred", "approximate"]


@dataclass(frozen=True, slots=True)
class AuditCase:
    """One audited attempt: the block keys it was routed on and their block size, the cached
    tokens predicted and reported, what the index said at dispatch, how the features were made
    (module docstring), a deferred request's whole-prompt keys (None until its encode finished),
    the prompt's length as the gateway (exact features only) and the engine counted it, and
    whether the replica's agent says the index may miss some of its blocks."""

    keys: Sequence[int]
    block_size: int
    predicted: int
    reported: int
    at_dispatch: IndexAtDispatch
    kind: FeatureKind = "exact"
    full_keys: Sequence[int] | None = None
    gateway_tokens: int | None = None
    engine_tokens: int | None = None
    agent_degraded: bool = False

    def tokens_agree(self) -> bool | None:
        """Whether the engine counted the prompt as the gateway's tokens have it (None: unknown):
        the same length for exact features; for a deferred request, a length within the last
        block its whole keys leave room for."""
        n = self.engine_tokens
        if n is None:
            return None
        if self.gateway_tokens is not None:
            return n == self.gateway_tokens
        if self.full_keys is not None:
            low = len(self.full_keys) * self.block_size
            return low <= n < low + self.block_size
        return None


def inexact_cause(index: PrefixIndex, replica: str, case: AuditCase) -> str:
    """The cause of an inexact prediction (module docstring); ``predicted != reported``."""
    if case.kind == "approximate":
        return "approximate_features"
    if case.predicted > case.reported:
        return _over_cause(index, replica, case)
    return _under_cause(index, replica, case)


def _over_cause(index: PrefixIndex, replica: str, case: AuditCase) -> str:
    at = case.at_dispatch
    if at.precise_blocks <= case.reported // max(1, case.block_size):  # the first block missing
        return "concurrent_not_stored"
    if index.removed_count(replica) > at.removed:
        return "evicted"
    return "tokenization" if case.tokens_agree() is False else "stale_index"


def _under_cause(index: PrefixIndex, replica: str, case: AuditCase) -> str:
    if case.at_dispatch.estimated_evicted:  # blocks P.. were the ones taken as evicted
        return "eviction_estimate"
    bs = max(1, case.block_size)
    had = -(-case.reported // bs)  # blocks the engine had for the request
    keys = case.keys if case.full_keys is None else case.full_keys
    if had > len(keys) and (case.kind == "exact" or case.full_keys is not None):
        return "tokenization"  # more blocks than the prompt has
    n = min(had, len(keys))
    held = index.precise_run(replica, keys[:n]) >= n  # by the index now
    agree = case.tokens_agree()
    if case.kind == "deferred" and case.predicted // bs >= len(case.keys):
        # the first block not credited had no key at the decision
        checked = case.full_keys is not None and not held and agree is False
        return "tokenization" if checked else "deferred_encode"
    if held:
        return "not_yet_reported"
    if agree is not True:
        return "tokenization"
    # the engine's blocks carry the request's keys (same tokens); the index lacked them at the
    # decision and lacks them now: stored after it and evicted since, or still on their way,
    # unless the agent says the index may miss blocks
    return "stale_index" if case.agent_degraded else "not_yet_reported"


class AttemptAudit:
    """What one attempt's audit needs besides the engine's report: the index at dispatch, how
    the features were made and, for a prompt encoded after routing, its whole keys once that
    encode is done. ``Upstream.send`` creates it at dispatch, before its first await, so its
    wrapper of the deferred job's ``on_keys`` (set by the proxy for this attempt, replaced on a
    retry) is in place before the job can finish; the wrapper runs on the event loop."""

    __slots__ = ("_job", "at_dispatch", "full_keys", "kind")

    def __init__(self, info: FeatureInfo, at_dispatch: IndexAtDispatch) -> None:
        self.at_dispatch = at_dispatch
        self.kind: FeatureKind = "approximate" if info.approximate else "exact"
        self.full_keys: list[int] | None = None
        self._job: DeferredJob | None = None
        if info.deferred_chars:
            self.kind = "deferred"
            if info.deferred is not None:
                self._job = info.deferred
                self._watch(info.deferred)

    def waiting(self) -> bool:
        """The prompt's whole keys are still being encoded: an audit can wait for them."""
        job = self._job
        return job is not None and self.full_keys is None and not job.finished.is_set()

    async def encoded(self, timeout_s: float) -> None:
        """Until the deferred encode is done (its keys then in ``full_keys``, unless the backlog
        dropped the job) or ``timeout_s`` passed."""
        if self._job is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._job.finished.wait(), timeout_s)

    def _watch(self, job: DeferredJob) -> None:
        if job.finished.is_set():
            return  # over: it calls nothing more (DeferredJob's invariant)
        inner = job.on_keys

        def on_keys(keys: list[int]) -> None:
            self.full_keys = keys
            if inner is not None:
                inner(keys)

        job.on_keys = on_keys

    def case(self, f: RequestFeatures, record: ReplicaRecord, predicted: int, engine: Usage) -> AuditCase:
        """The attempt's ``AuditCase`` on ``record``'s replica, from the engine's usage block
        (one that reports cached tokens)."""
        reported = engine.reported_cached
        assert reported is not None
        return AuditCase(
            f.block_keys,
            f.block_size,
            predicted,
            reported,
            self.at_dispatch,
            self.kind,
            self.full_keys,
            f.prompt_tokens if self.kind == "exact" else None,
            engine.prompt_tokens,
            record.link.degraded,
        )


def record_audit(
    metrics: GatewayMetrics, record: ReplicaRecord, predicted: int, reported: int, cause: str | None = None
) -> None:
    """Count one audited request in the replica's statistics (their only writer) and metrics;
    ``cause``: why an inexact prediction was inexact (``inexact_cause``; given iff inexact)."""
    outcome = record.audit.record(predicted, reported, cause)
    metrics.audit_by(record.id, outcome).inc()
    metrics.audit_error_by(record.id).observe(predicted - reported)
    if cause is not None:
        metrics.audit_cause_by(record.id, cause).inc()


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
