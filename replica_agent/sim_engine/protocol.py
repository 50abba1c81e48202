"""vLLM's OpenAI-compatible request parsing and response shapes (vllm/entrypoints/openai/protocol.py).

Only what a simulated engine needs: one prompt per request (``n`` = 1), pseudo-token output,
``finish_reason`` "length". Errors use vLLM's envelope ``{"error": {"message", "type", "param",
"code"}}`` where ``code`` is the HTTP status, as vLLM sets it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from replica_agent.sim_engine.tokenization import EngineTokenizer


class ApiError(Exception):
    """An error answered to the client with vLLM's error JSON."""

    _TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        err_type = self._TYPES.get(self.status, "InternalServerError")
        return {
            "error": {"message": self.message, "type": err_type, "param": self.param, "code": self.status}
        }


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    chat: bool
    model: str
    prompt_tokens: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool


@dataclass(frozen=True, slots=True)
class ServingLimits:
    model: str
    max_model_len: int
    default_max_tokens: int


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    return body


def check_model(body: dict[str, Any], limits: ServingLimits) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    if model != limits.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")


def _int_field(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name)
    if value < minimum:
        raise _bad(f"'{name}' must be at least {minimum}, got {value}", name)
    return value


def _stream_fields(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False, False
    if not stream:
        raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
    if not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    include = opts.get("include_usage", True)
    continuous = opts.get("continuous_usage_stats", False)
    if not isinstance(include, bool) or not isinstance(continuous, bool):
        raise _bad("stream_options fields must be booleans", "stream_options")
    return stream, include, continuous


def _check_unsupported(body: dict[str, Any]) -> None:
    # A cache salt changes vLLM's block hashes and kvgate's key namespace; this engine keys every
    # block in the model's namespace only, so it refuses a salt rather than key it wrongly.
    if body.get("cache_salt") is not None:
        raise _bad("'cache_salt' is not supported by the simulated engine", "cache_salt")


def _check_n(body: dict[str, Any]) -> None:
    _check_unsupported(body)
    n = _int_field(body, "n", 1)
    if n is not None and n != 1:
        raise _bad("the simulated engine generates one choice per request (n must be 1)", "n")


def _check_token_ids(ids: list[Any], vocab_size: int, param: str) -> list[int]:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise _bad(f"token id {t!r} is out of vocabulary (size {vocab_size})", param)
    return ids


def _finish(
    chat: bool,
    body: dict[str, Any],
    tokens: list[int],
    max_tokens: int | None,
    limits: ServingLimits,
) -> GenerationRequest:
    if not tokens:
        raise _bad("Prompt cannot be empty", "messages" if chat else "prompt")
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    if len(tokens) + max_tokens > limits.max_model_len:
        raise _bad(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
            f"requested {len(tokens) + max_tokens} tokens ({len(tokens)} in the "
            f"{'messages' if chat else 'prompt'}, {max_tokens} in the completion). Please reduce the "
            "length of the input or completion.",
            "max_tokens",
        )
    stream, include_usage, continuous = _stream_fields(body)
    return GenerationRequest(chat, limits.model, tokens, max_tokens, stream, include_usage, continuous)


def parse_completion(raw: Any, tok: EngineTokenizer, limits: ServingLimits) -> GenerationRequest:
    body = _require_object(raw)
    check_model(body, limits)
    _check_n(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        tokens = tok.encode_prompt(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        tokens = _check_token_ids(prompt, tok.vocab_size, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise _bad("the simulated engine takes one prompt per request", "prompt")
    else:
        raise _bad("'prompt' must be a string or a list of token ids", "prompt")
    return _finish(False, body, tokens, _int_field(body, "max_tokens", 1), limits)


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _bad(f"messages[{index}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "\n".join(parts)  # vLLM joins text parts with a newline
    raise _bad(f"messages[{index}].content must be a string or a list of text parts", "messages")


def parse_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        msg = dict(m)
        msg["content"] = _message_text(m.get("content"), i)
        out.append(msg)
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise _bad("'tools' must be a list of objects", "tools")
    return out, tools


def chat_tokens(body: dict[str, Any], tok: EngineTokenizer) -> list[int]:
    messages, tools = parse_messages(body)
    agp = body.get("add_generation_prompt", True)
    if not isinstance(agp, bool):
        raise _bad("'add_generation_prompt' must be a boolean", "add_generation_prompt")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    try:
        text = tok.render_chat(messages, tools, agp, kwargs)
    except Exception as exc:  # a template error is the request's fault (jinja raises many kinds)
        raise _bad(f"chat template failed: {exc}", "messages") from exc
    return tok.encode_chat_text(text)


def parse_chat(raw: Any, tok: EngineTokenizer, limits: ServingLimits) -> GenerationRequest:
    body = _require_object(raw)
    check_model(body, limits)
    _check_n(body)
    tokens = chat_tokens(body, tok)
    max_tokens = _int_field(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", 1)
    return _finish(True, body, tokens, max_tokens, limits)


def parse_tokenize(raw: Any, tok: EngineTokenizer, limits: ServingLimits) -> dict[str, Any]:
    """vLLM's /tokenize: ``{"model", "prompt"}`` or ``{"model", "messages", ...}`` ->
    ``{"count", "max_model_len", "tokens", "token_strs"}`` (token_strs only on request)."""
    body = _require_object(raw)
    check_model(body, limits)
    if "messages" in body:
        tokens = chat_tokens(body, tok)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise _bad("'prompt' must be a string (or give 'messages')", "prompt")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise _bad("'add_special_tokens' must be a boolean", "add_special_tokens")
        tokens = tok.encode_prompt(prompt) if add_special else tok.encode_chat_text(prompt)
    want_strs = body.get("return_token_strs", False)
    return {
        "count": len(tokens),
        "max_model_len": limits.max_model_len,
        "tokens": tokens,
        "token_strs": tok.token_strs(tokens) if want_strs else None,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def full_response(
    req: GenerationRequest, rid: str, created: int, text: str, finish: str, use: dict[str, Any]
) -> dict[str, Any]:
    if req.chat:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning_content": None,
        }
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": use,
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def chunk(
    req: GenerationRequest,
    rid: str,
    created: int,
    text: str,
    finish: str | None,
    first: bool,
    use: dict[str, Any] | None,
) -> dict[str, Any]:
    """One streamed chunk. Chat's first chunk carries the role; the chunk with the last token
    carries the finish reason; ``use`` is set with continuous usage stats."""
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        obj = "text_completion"
    out: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": [choice],
    }
    if use is not None:
        out["usage"] = use
    return out


def usage_chunk(req: GenerationRequest, rid: str, created: int, use: dict[str, Any]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [], "usage": use}


def model_list(model: str, root: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{model}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }


def now_s() -> int:
    return int(time.time())
