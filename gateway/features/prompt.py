"""Reading a request's prompt (docs/architecture.md, "Request path": features): what is to be
keyed, as exactly one of

- ``TokenIds``: tokens known without encoding (a completions prompt given as ids, or the ids a
  replica's ``/tokenize`` returned);
- ``Text``: text to encode here (a completions prompt, or a chat rendered by its template);
- ``Chars``: text keyed on character blocks (no tokenizer, or a fallback with its reason);
- ``Remote``: ask a replica's ``/tokenize`` (``tokenizer: remote``).

``read_prompt`` validates the prompt fields (raising ``InvalidRequestError`` naming the field)
and renders chat templates; its only side effect is the registry's memo keeping a rendering (exact
and bounded in bytes), which ``Featurizer.featurize(explain=True)`` reads with ``read_only``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from gateway.features.chat_request import (
    Unrepresentable,
    chat_prompt_of,
    completion_prompt_of,
    conversation_of,
    plain_text_of_chat,
    tools_of,
    truncation_of,
)
from gateway.features.chat_template import TemplateRenderError
from gateway.features.model_registry import ModelRegistry, Resolved
from gateway.features.segment_encoder import TokenArray
from gateway.request import ParsedRequest
from gateway.request_errors import InvalidRequestError

FallbackKind = Literal["unrepresentable", "remote_failed", "sync_call"]


@dataclass(frozen=True, slots=True)
class TokenIds:
    tokens: TokenArray
    source: Literal["token_ids", "remote"]


@dataclass(frozen=True, slots=True)
class Text:
    text: str
    add_special_tokens: bool


@dataclass(frozen=True, slots=True)
class Chars:
    text: str
    fallback_reason: str | None = None  # why an exact mode fell back to characters
    fallback_kind: FallbackKind | None = None


@dataclass(frozen=True, slots=True)
class Remote:
    pass


Prompt = TokenIds | Text | Chars | Remote


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """Everything about a request the keys depend on besides its prompt."""

    resolved: Resolved
    salt: str | None  # the body's cache_salt
    truncate: int | None  # truncate_prompt_tokens
    truncation_side: str


def _salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not 1 <= len(salt) <= 1024:
        raise InvalidRequestError("'cache_salt' must be a string of 1 to 1024 characters", param="cache_salt")
    return salt


def chars_of(req: ParsedRequest) -> str:
    """The prompt as plain text (the character-block fallback); lenient about content parts."""
    body = req.body
    if req.endpoint == "chat":
        conversation = conversation_of(body.get("messages"), "string", lenient=True)
        return plain_text_of_chat(conversation, tools_of(body.get("tools")))
    prompt = completion_prompt_of(body)
    return prompt if isinstance(prompt, str) else ""


def read_prompt(req: ParsedRequest, models: ModelRegistry) -> tuple[PromptSpec, Prompt]:
    """The request's model and key inputs, and its prompt (raises ``RequestError``)."""
    resolved = models.resolve(req.model)
    salt = _salt(req.body)
    truncate, side = truncation_of(req.body)
    spec = PromptSpec(resolved, salt, truncate, side)
    try:
        if req.endpoint == "completions":
            return spec, _completion(req.body, resolved)
        return spec, _chat(req.body, resolved)
    except Unrepresentable as exc:
        return spec, Chars(chars_of(req), f"unrepresentable input: {exc}", "unrepresentable")


def _completion(body: Mapping[str, Any], resolved: Resolved) -> Prompt:
    prompt = completion_prompt_of(body)
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise InvalidRequestError("'add_special_tokens' must be a boolean", param="add_special_tokens")
    local = resolved.model.local
    if isinstance(prompt, list):
        if local is not None and max(prompt) >= local.vocab_size:
            raise InvalidRequestError(
                f"token id {max(prompt)} is out of vocabulary (size {local.vocab_size})", param="prompt"
            )
        return TokenIds(np.asarray(prompt, dtype=np.uint32), "token_ids")
    if local is not None:
        return Text(prompt, add_special)
    return Remote() if resolved.model.remote else Chars(prompt)


def _chat(body: Mapping[str, Any], resolved: Resolved) -> Prompt:
    local = resolved.model.local
    if local is None:
        conversation = conversation_of(body.get("messages"), "string")  # validates the messages
        tools = tools_of(body.get("tools"))
        return Remote() if resolved.model.remote else Chars(plain_text_of_chat(conversation, tools))
    template = local.template(body.get("tools") is not None)
    chat = chat_prompt_of(body, template.content_format, template.variables)
    try:
        text = template.render(
            chat.conversation,
            tools=chat.tools,
            documents=chat.documents,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            kwargs=chat.template_kwargs,
        )
    except TemplateRenderError as exc:
        raise InvalidRequestError(
            f"chat template error: {exc}", param="messages", code="template_error"
        ) from None
    return Text(text, chat.add_special_tokens)
