"""Reading the prompt out of a request body the way vLLM's OpenAI server reads it.

Chat (checked against vLLM's ``entrypoints/chat_utils.py`` and its chat request protocol):
- ``content`` given as a string, ``null`` (an empty string) or a list of parts; with a "string"
  template the text parts (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``)
  are joined with ``"\\n"``; with an "openai" template the content becomes a list of
  ``{"type": "text", "text": ...}`` parts. Parts with a ``null`` text are skipped. Other part
  types (images, audio...) change the prompt in model-specific ways we cannot reproduce:
  ``Unrepresentable`` makes the featurizer fall back to approximate routing.
- assistant messages keep ``tool_calls`` (an empty list is dropped; each ``function.arguments``
  JSON string is parsed into an object, ``{}`` when it is not valid JSON) and their reasoning
  (``reasoning`` or the older ``reasoning_content``); tool messages keep ``tool_call_id`` and
  their text parts become one string; ``name`` and ``task`` are kept when strings; developer
  messages keep ``tools``.
- tools become ``{"type", "function": {"name", "description", "parameters", ...extra}}`` as
  vLLM's pydantic models dump them (missing description/parameters become ``null``).
- the template variables: ``chat_template_kwargs`` first, then the request's own
  ``add_generation_prompt`` (default true), ``continue_final_message``, ``documents``, and
  ``enable_thinking`` when ``reasoning_effort`` is given; only names the template reads (or
  transformers' own arguments) are passed on.

Completions: ``prompt`` is a string or a list of token ids; a batch of one is accepted as that
one prompt, larger batches are refused (a routed request has one prompt).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.features.chat_template import ContentFormat
from gateway.request_errors import InvalidRequestError

_TEXT_PART_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_SKIP_NONE_PART_TYPES = ("text", "refusal")
# transformers' apply_chat_template arguments that never reach the template as variables
_RESERVED_KWARGS = frozenset({"chat_template", "tokenize", "tools", "conversation", "messages"})
_APPLY_ARGS = frozenset(
    {
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class Unrepresentable(Exception):
    """The request is valid but holds input (images, audio, prompt embeddings) whose tokens only
    the engine can produce; route it approximately."""


@dataclass(frozen=True)
class ChatPrompt:
    conversation: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    documents: list[Any] | None
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    template_kwargs: dict[str, Any]  # everything else the template may read


def _is_object(value: Any) -> bool:
    """A JSON object: orjson gives dicts (checked first, it is much cheaper than the ABC)."""
    return isinstance(value, dict | Mapping)


def _bool_field(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"'{name}' must be a boolean", param=name)
    return value


def _text_of_part(part: Any, where: str, lenient: bool = False) -> tuple[str, str | None]:
    """(part type, its text or None to skip); raises Unrepresentable for media parts unless
    ``lenient`` (then they are skipped)."""
    if isinstance(part, str):
        return "text", part
    if not _is_object(part):
        raise InvalidRequestError(f"{where} must be a string or an object", param=where)
    ptype = part.get("type")
    if ptype is None:
        if any(k in part for k in ("image_url", "audio_url", "video_url", "input_audio", "image_embeds")):
            if lenient:
                return "media", None
            raise Unrepresentable(f"{where} carries media")
        raise InvalidRequestError(f"{where}: missing 'type' field", param=f"{where}.type")
    if not isinstance(ptype, str):
        raise InvalidRequestError(f"{where}.type must be a string", param=f"{where}.type")
    field_name = _TEXT_PART_FIELDS.get(ptype)
    if field_name is None:
        if lenient:
            return ptype, None
        raise Unrepresentable(f"{where} is a {ptype!r} part")
    text = part.get(field_name)
    if text is None:
        if ptype in _SKIP_NONE_PART_TYPES:
            return ptype, None
        raise InvalidRequestError(f"{where}.{field_name} must be a string", param=f"{where}.{field_name}")
    if not isinstance(text, str):
        raise InvalidRequestError(f"{where}.{field_name} must be a string", param=f"{where}.{field_name}")
    return ptype, text


def _content(raw: Any, fmt: ContentFormat, where: str, lenient: bool) -> str | list[dict[str, str]]:
    if raw is None:
        texts: list[str] = []
    elif isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list):
        texts = []
        for j, part in enumerate(raw):
            _, text = _text_of_part(part, f"{where}[{j}]", lenient)
            if text is not None:
                texts.append(text)
    else:
        raise InvalidRequestError(f"{where} must be a string, null or a list of content parts", param=where)
    if fmt == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def _tool_calls(raw: Any, where: str) -> list[Any]:
    if not isinstance(raw, list):
        raise InvalidRequestError(f"{where} must be a list", param=where)
    calls: list[Any] = []
    for j, call in enumerate(raw):
        if not _is_object(call) or not _is_object(call.get("function")):
            raise InvalidRequestError(
                f"{where}[{j}] must be an object with a 'function' object", param=f"{where}[{j}]"
            )
        fn = dict(call["function"])
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except json.JSONDecodeError:
                fn["arguments"] = {}
        elif not isinstance(args, dict | list):
            fn["arguments"] = {}
        calls.append({**call, "function": fn})
    return calls


def _objects(raw: Any, name: str) -> list[tuple[str, Any]]:
    """``(where, item)`` of each item of the request field ``name``, which must be a list of
    objects."""
    if not isinstance(raw, list):
        raise InvalidRequestError(f"'{name}' must be a list of {name}", param=name)
    out = []
    for i, item in enumerate(raw):
        where = f"{name}[{i}]"
        if not _is_object(item):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        out.append((where, item))
    return out


def conversation_of(messages: Any, fmt: ContentFormat, *, lenient: bool = False) -> list[dict[str, Any]]:
    """vLLM's conversation; ``lenient`` skips media parts instead of raising Unrepresentable
    (for the approximate text only)."""
    items = _objects(messages, "messages")
    if not items:
        raise InvalidRequestError("'messages' must not be empty", param="messages")
    out: list[dict[str, Any]] = []
    for where, m in items:
        role = m.get("role")
        if not isinstance(role, str):
            raise InvalidRequestError(f"{where}.role must be a string", param=f"{where}.role")
        content = _content(m.get("content"), fmt, f"{where}.content", lenient)
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None:
                parsed = _tool_calls(calls, f"{where}.tool_calls")
                if parsed:
                    msg["tool_calls"] = parsed
            reasoning = m.get("reasoning")
            if reasoning is None:
                reasoning = m.get("reasoning_content")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise InvalidRequestError(
                        f"{where}.reasoning must be a string", param=f"{where}.reasoning"
                    )
                msg["reasoning"] = reasoning
                msg["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in m:
                msg["tool_call_id"] = m["tool_call_id"]
            if isinstance(content, list):
                msg["content"] = "\n".join(p["text"] for p in content)
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if isinstance(m.get("task"), str):
            msg["task"] = m["task"]
        if role == "developer":
            msg["tools"] = m.get("tools")
        out.append(msg)
    return out


def tools_of(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    tools: list[dict[str, Any]] = []
    for where, tool in _objects(raw, "tools"):
        fn = tool.get("function")
        if not _is_object(fn):
            raise InvalidRequestError(f"{where}.function must be an object", param=f"{where}.function")
        if not isinstance(fn.get("name"), str):
            raise InvalidRequestError(
                f"{where}.function.name must be a string", param=f"{where}.function.name"
            )
        params = fn.get("parameters")
        if params is not None and not _is_object(params):
            raise InvalidRequestError(
                f"{where}.function.parameters must be an object", param=f"{where}.function.parameters"
            )
        function: dict[str, Any] = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": params,
        }
        defer = fn.get("defer_loading", tool.get("defer_loading"))
        for k, v in fn.items():
            if k not in function and k != "defer_loading":
                function[k] = v
        if defer is not None:
            function["defer_loading"] = defer
        dumped: dict[str, Any] = {"type": tool.get("type", "function"), "function": function}
        if tool.get("defer_loading") is not None:
            dumped["defer_loading"] = tool["defer_loading"]
        tools.append(dumped)
    return tools


def chat_prompt_of(
    body: Mapping[str, Any], fmt: ContentFormat, template_variables: frozenset[str]
) -> ChatPrompt:
    conversation = conversation_of(body.get("messages"), fmt)
    tools = tools_of(body.get("tools"))
    user_kwargs = body.get("chat_template_kwargs")
    if user_kwargs is None:
        user_kwargs = {}
    if not _is_object(user_kwargs):
        raise InvalidRequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    reserved = sorted(_RESERVED_KWARGS & user_kwargs.keys())
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
        )
    for name in ("sanitize_control_tokens", "return_assistant_tokens_mask"):
        if user_kwargs.get(name):
            raise InvalidRequestError(
                f"chat_template_kwargs.{name} is not supported for chat requests",
                param="chat_template_kwargs",
            )
    merged: dict[str, Any] = dict(user_kwargs)
    merged["add_generation_prompt"] = _bool_field(body, "add_generation_prompt", True)
    merged["continue_final_message"] = _bool_field(body, "continue_final_message", False)
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list):
            raise InvalidRequestError("'documents' must be a list", param="documents")
        merged["documents"] = documents
    effort = body.get("reasoning_effort")
    if effort is not None:
        merged["reasoning_effort"] = effort
        if "enable_thinking" not in user_kwargs:
            merged["enable_thinking"] = effort != "none"
    if merged["add_generation_prompt"] and merged["continue_final_message"]:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    docs = merged.pop("documents", None)
    if docs is not None and (not isinstance(docs, list) or not all(_is_object(d) for d in docs)):
        raise InvalidRequestError("'documents' must be a list of objects", param="documents")
    agp = bool(merged.pop("add_generation_prompt"))
    cfm = bool(merged.pop("continue_final_message"))
    template_kwargs = {k: v for k, v in merged.items() if k in template_variables and k not in _APPLY_ARGS}
    return ChatPrompt(
        conversation=conversation,
        tools=tools,
        documents=docs,
        add_generation_prompt=agp,
        continue_final_message=cfm,
        add_special_tokens=_bool_field(body, "add_special_tokens", False),
        template_kwargs=template_kwargs,
    )


def completion_prompt_of(body: Mapping[str, Any]) -> str | list[int]:
    """The one prompt of a completions body: its text or its token ids."""
    if "prompt" not in body or body["prompt"] is None:
        if body.get("prompt_embeds") is not None:
            raise Unrepresentable("prompt_embeds")
        raise InvalidRequestError("'prompt' is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one is that one prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, str | list) for p in prompt):
            raise InvalidRequestError(
                "batched prompts are not supported: send one prompt per request", param="prompt"
            )
        if not prompt:
            raise InvalidRequestError("'prompt' must not be empty", param="prompt")
        for j, t in enumerate(prompt):
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t > 0xFFFFFFFF:
                raise InvalidRequestError(
                    f"prompt[{j}] must be a token id (a non-negative integer)", param="prompt"
                )
        return list(prompt)
    raise InvalidRequestError("'prompt' must be a string or a list of token ids", param="prompt")


def truncation_of(body: Mapping[str, Any]) -> tuple[int | None, str]:
    """``truncate_prompt_tokens`` (keep that many tokens; -1 or absent: no truncation we can
    apply, since it means the model's context length) and the side to cut from: the request's
    ``truncation_side``, else "left" (vLLM creates its tokenizers with ``truncation_side="left"``,
    keeping the end of the prompt)."""
    keep = body.get("truncate_prompt_tokens")
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < -1):
        raise InvalidRequestError(
            "'truncate_prompt_tokens' must be an integer >= -1", param="truncate_prompt_tokens"
        )
    side = body.get("truncation_side") or "left"
    if side not in ("left", "right"):
        raise InvalidRequestError("'truncation_side' must be 'left' or 'right'", param="truncation_side")
    return (None if keep is None or keep < 0 else keep), side


def plain_text_of_chat(conversation: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """A deterministic stand-in for the rendered prompt when no template can be used (approximate
    routing on characters): tools, then each message as ``role\\ncontent\\n``."""
    pieces: list[str] = []
    if tools:
        pieces.append(json.dumps(tools, ensure_ascii=False))
    for m in conversation:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if _is_object(p))
        pieces.append(f"{m.get('role')}\n{content or ''}\n")
    return "".join(pieces)
