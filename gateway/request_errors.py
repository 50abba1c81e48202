"""The request errors the request path raises, all ``RequestError`` (gateway/openai_errors.py),
answered as OpenAI's error JSON ``{"error": {"message", "type", "param", "code"}}`` with
``status`` by ``openai_errors.error_response_of`` (docs/architecture.md, "Request path").

``param`` names the offending field the way OpenAI does (``messages[2].content``, ``prompt``,
``model``), so a client can find the fault without reading gateway logs.
"""

from __future__ import annotations

from gateway.openai_errors import RequestError

__all__ = ["InvalidRequestError", "UnknownModelError"]


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
