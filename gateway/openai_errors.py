"""OpenAI's error shape, for every error the gateway itself produces (docs/architecture.md).

Every error a request causes is a ``RequestError`` (one type, whatever raised it) and becomes
HTTP here, in ``error_response_of``.

Over HTTP: ``{"error": {"message", "type", "param", "code"}}`` with the matching status. Inside an
SSE stream that already started (a replica died mid-stream) the same object goes out as one last
``data:`` event, since the status line was already sent.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

log = logging.getLogger("kvgate.http")

# status -> OpenAI error type, as the OpenAI API and vLLM use them
_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class RequestError(Exception):
    """The one error type for a request the gateway answers itself (bad body, bad field, unknown
    model, no replica...): raised anywhere on the request path, answered by ``error_response_of``.

    ``type`` defaults to the status's OpenAI type; a subclass may name a more precise one
    (``not_found_error`` for an unknown model), and that is the type the client gets."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "api_error")

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error document (``{"error": {...}}``)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r}, status={self.status})"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps(RequestError(message, status=status, param=param, code=code).to_dict())


def error_response_of(exc: RequestError) -> web.Response:
    """The HTTP answer to ``exc``: its status and its OpenAI error document (with its type)."""
    return web.Response(status=exc.status, body=orjson.dumps(exc.to_dict()), content_type="application/json")


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, param, code),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """One SSE event carrying the error object, then the stream terminator clients wait for."""
    return b"data: " + error_body(status, message, None, code) + b"\n\ndata: [DONE]\n\n"


@web.middleware
async def openai_errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own errors (unknown path 404, wrong method 405, oversized admin body 413) and any
    unexpected exception become OpenAI error JSON instead of text/plain or a bare 500."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, f"{exc.reason}: {request.method} {request.path}")
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal gateway error", code="internal_error")
