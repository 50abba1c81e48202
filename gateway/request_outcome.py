"""One answered request as the operator view sees it (docs/architecture.md, "Operator view").

``Upstream`` calls ``OutcomeSink.answered(attempt, usage)`` once per request the engine answered
with 200, once its bytes were relayed and before the response's end is written (so the sink must
not raise into the request: ``OperatorView.answered`` guards it); ``usage`` (prompt, cached and
completion tokens) is parsed once by ``Upstream`` from the bytes the prediction audit also reads
(None when the engine sent none). Nothing here changes the response or any routing state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from gateway.prediction_audit import last_in_sse_tail
from gateway.request_context import Attempt

OTHER_TENANT = "other"
DEFAULT_TENANT = "default"
MAX_LABEL_CHARS = 64


class OutcomeSink(Protocol):
    def answered(self, a: Attempt, use: Usage | None) -> None:
        """``a`` was answered with 200; ``use``: the answer's usage block (parsed once, by the
        upstream, for the prediction audit and this sink alike), None when it carried none."""
        ...

    def deferred(self, a: Attempt) -> None:
        """``a``'s prompt is encoded after routing: its ``info.deferred.on_keys`` was just set
        (the sink may wrap it to learn the keys too)."""
        ...


@dataclass(frozen=True, slots=True)
class Usage:
    """An answer's usage block; a field the engine left out is None."""

    prompt_tokens: int | None
    completion_tokens: int | None
    reported_cached: int | None  # usage.prompt_tokens_details.cached_tokens; None: the engine gave none

    @property
    def cached_tokens(self) -> int:
        return self.reported_cached or 0


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def usage_of(doc: Any) -> Usage | None:
    """The usage block of a completion document (None: no usage block, or none of its counts)."""
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    use = Usage(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")), cached)
    return None if use == Usage(None, None, None) else use


def usage_in(body: bytes, sse: bool) -> Usage | None:
    """The usage of a whole JSON body, or of the last SSE event carrying one in a stream's tail."""
    if not sse:
        try:
            return usage_of(orjson.loads(body))
        except orjson.JSONDecodeError:
            return None
    return last_in_sse_tail(body, usage_of)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the operator view keeps of one answered request (no text)."""

    arrival: float  # time.monotonic() when the request arrived
    done: float  # time.monotonic() when it was answered
    model: str
    tenant: str
    session_id: str | None
    replica: str
    prompt_tokens: int  # the engine's count when it reported usage, else the gateway's
    gateway_prompt_tokens: int  # the gateway's count: the one its block keys cover
    completion_tokens: int  # the engine's count, else the request's max_tokens
    cached_tokens: int | None  # engine-reported; None when the answer carried no usage
    predicted_tokens: int
    ttft_s: float | None
    block_keys: tuple[int, ...]  # the prompt's full blocks (empty when the features were approximate)
    block_size: int


def tenant_label(raw: str | None) -> str:
    """A header value as a label: bounded in length, ``default`` when absent or empty."""
    if not raw:
        return DEFAULT_TENANT
    return raw.strip()[:MAX_LABEL_CHARS] or DEFAULT_TENANT


def _or(value: int | None, fallback: int) -> int:
    return fallback if value is None else value


def outcome_of(a: Attempt, use: Usage | None, tenant_header: str) -> Outcome:
    ctx, features = a.ctx, a.features
    assert ctx.parsed is not None
    ttft_ms = ctx.log.get("ttft_ms")
    now = time.monotonic()
    return Outcome(
        arrival=now - ctx.elapsed(),
        done=now,
        model=features.model,
        tenant=tenant_label(ctx.request.headers.get(tenant_header)),
        session_id=ctx.parsed.session_id,
        replica=a.record.id,
        prompt_tokens=_or(use.prompt_tokens if use else None, features.prompt_tokens),
        gateway_prompt_tokens=features.prompt_tokens,
        completion_tokens=_or(use.completion_tokens if use else None, ctx.parsed.max_output_tokens),
        cached_tokens=use.cached_tokens if use is not None else None,
        predicted_tokens=a.choice.predicted_tokens,
        ttft_s=ttft_ms / 1000 if isinstance(ttft_ms, int | float) else None,
        block_keys=tuple(features.block_keys) if a.info.exact else (),
        block_size=features.block_size,
    )
