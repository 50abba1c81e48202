"""Errors a client's request causes, raised while reading it and mapped by the proxy to OpenAI's
error JSON: ``{"error": {"message", "type", "param", "code"}}`` with ``status``.

``param`` names the offending field the way OpenAI does (``messages[2].content``, ``prompt``,
``model``), so a client can find the fault without reading gateway logs.

``RequestError`` is a ``RequestRejected`` (the proxy's own "answer this with an OpenAI error"
exception, same fields), so the proxy's existing handler answers it without a second except.
"""

from __future__ import annotations

from typing import Any

from gateway.openai_errors import RequestRejected


class RequestError(RequestRejected):
    """A request the gateway refuses; ``status`` is the HTTP status to answer with."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(status, message, param=param, code=code)
        self.type = type

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error object (what goes under the top-level ``"error"`` key's parent)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r}, status={self.status})"


class InvalidRequestError(RequestError):
    """400: the body is well-formed JSON but a field is missing, of the wrong type or unusable."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "invalid_value") -> None:
        super().__init__(message, param=param, status=400, type="invalid_request_error", code=code)


class UnknownModelError(RequestError):
    """404: the ``model`` field names neither a configured model nor one of its LoRA adapters."""

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist.",
            param="model",
            status=404,
            type="not_found_error",
            code="model_not_found",
        )
        self.model = model
