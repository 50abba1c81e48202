"""A client request, parsed and validated once (docs/architecture.md, "Request path", step 2).

``parse_request`` turns the body bytes into a frozen ``ParsedRequest``; ``request_of`` is the one
validation of the request envelope (a JSON object naming a model, with the prompt field of its
endpoint), used by the proxy, by ``/admin/explain`` and by the featurizer's convenience calls.
Field-level validation of the prompt (messages, content parts, token ids) happens where the
prompt is read (``gateway.features.prompt``), raising the same ``RequestError``.

The bytes sent upstream are the bytes received (``raw``), never re-serialised; ``body`` is the
parsed document, read-only by convention (nothing on the request path writes to it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.request_errors import InvalidRequestError

Endpoint = Literal["completions", "chat"]
PROMPT_FIELD: Mapping[Endpoint, str] = {"chat": "messages", "completions": "prompt"}
_NAMED: Mapping[str, Endpoint] = {
    "chat": "chat",
    "/v1/chat/completions": "chat",
    "completions": "completions",
    "/v1/completions": "completions",
}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    model: str  # as the client named it (a model or one of its LoRA adapters)
    stream: bool
    body: Mapping[str, Any]
    raw: bytes  # forwarded upstream as is (empty when the request came as a document)
    session_id: str | None  # from the configured session header
    prompt_field: str  # "messages" (chat) or "prompt" (completions)
    max_output_tokens: int  # max_tokens / max_completion_tokens when a positive int, else 0


def request_of(
    endpoint: Endpoint, body: Any, session_id: str | None = None, raw: bytes = b""
) -> ParsedRequest:
    """Validate the request envelope (raises ``InvalidRequestError``)."""
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("'model' must be a non-empty string", param="model")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        stream=body.get("stream") is True,
        body=body,
        raw=raw,
        session_id=session_id,
        prompt_field=PROMPT_FIELD[endpoint],
        max_output_tokens=max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0,
    )


def parse_json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"malformed JSON body: {exc}", code="invalid_json") from None


def parse_request(endpoint: Endpoint, raw: bytes, session_id: str | None) -> ParsedRequest:
    """The request of ``endpoint`` whose body is ``raw`` (raises ``InvalidRequestError``)."""
    return request_of(endpoint, parse_json(raw), session_id, raw)


def endpoint_of(named: str | None, body: Any) -> Endpoint:
    """The endpoint a request body is for when it did not come on one (``/admin/explain``): the
    one ``named`` ("chat" or "completions", or its path), else the one whose prompt field the
    body has; a body with both fields or neither must name it."""
    if named is not None:
        if named in _NAMED:
            return _NAMED[named]
        raise InvalidRequestError(
            f"unknown endpoint {named!r}: use 'chat' or 'completions'", param="endpoint"
        )
    if isinstance(body, Mapping):
        has = [e for e, f in PROMPT_FIELD.items() if f in body]
        if len(has) == 1:
            return has[0]
    raise InvalidRequestError(
        "the body must have exactly one of 'messages' (chat) and 'prompt' (completions), or the "
        "request must name its endpoint (?endpoint=chat or ?endpoint=completions)",
        param="endpoint",
    )
