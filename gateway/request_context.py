"""What one proxied request carries from the socket to the replica and back (docs/architecture.md,
"Request path"): ``RequestContext`` per request, ``Attempt`` per replica tried.

The context is created by ``Proxy._handle`` and owned by that request's task: its ``log`` (the
access-log record) and ``span`` are written only on that task, so there is no sharing to guard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.features.feature_info import FeatureInfo
from gateway.fleet import ReplicaRecord
from gateway.openai_errors import RequestError, error_response_of
from gateway.request import ParsedRequest
from gateway.routing import Choice, RoutingState, Speculation
from router_policies.flights import Dispatch
from router_policies.policy import RequestFeatures

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
DROP_REQUEST = HOP_BY_HOP | {"host", "content-length"}
DROP_RESPONSE = HOP_BY_HOP | {"content-length"}


def filter_headers(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str]
) -> CIMultiDict[str]:
    """Copy ``headers`` without hop-by-hop ones (including those the Connection header names)."""
    conn = headers.get("connection")
    named = {t.strip().lower() for t in conn.split(",")} if conn else set()
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk not in drop and lk not in named:
            out.add(k, v)
    return out


@dataclass(slots=True)
class RequestContext:
    request: web.Request
    state: RoutingState  # read once: a reload never mixes two configs in one request
    span: Any  # the OpenTelemetry span, or None
    t0: float = field(default_factory=time.perf_counter)
    log: dict[str, Any] = field(default_factory=dict)  # the access-log record
    parsed: ParsedRequest | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def error(self, exc: RequestError) -> web.Response:
        """Answer ``exc`` (OpenAI error JSON) and log its message."""
        self.log["error"] = exc.message
        return error_response_of(exc)

    def annotate(self, features: RequestFeatures, choice: Choice) -> None:
        """The decision in the access log and the span (a retry's overwrites the first)."""
        d = choice.decision
        log = self.log
        log["reason"] = d.reason
        log["matched_blocks"] = d.matched_blocks
        log["predicted_cached_tokens"] = choice.predicted_tokens
        log["replica"] = d.replica
        span = self.span
        if span is not None:
            span.set_attribute("kvgate.model", features.model)
            span.set_attribute("kvgate.replica", d.replica)
            span.set_attribute("kvgate.reason", d.reason)
            span.set_attribute("kvgate.prompt_tokens", features.prompt_tokens)
            span.set_attribute("kvgate.block_keys", len(features.block_keys))
            span.set_attribute("kvgate.matched_blocks", d.matched_blocks)
            span.set_attribute("kvgate.predicted_cached_tokens", choice.predicted_tokens)
            for rid, score in d.scores.items():
                span.set_attribute(f"kvgate.score.{rid}", float(score))


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of the request on one replica."""

    ctx: RequestContext
    features: RequestFeatures
    info: FeatureInfo
    choice: Choice
    dispatch: Dispatch  # as placement accounts for it (its flight opens in ``Upstream.send``)
    speculation: Speculation  # the committed entries, undone if this attempt is retried
    may_retry: bool  # a failure before the first byte may go to another replica

    @property
    def record(self) -> ReplicaRecord:
        return self.choice.record
