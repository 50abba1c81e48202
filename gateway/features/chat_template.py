"""Rendering a model's Jinja chat template exactly as ``transformers.apply_chat_template`` does.

The environment matches transformers' (checked against transformers 5.23's
``utils/chat_template_utils.py``): an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` block tag that only
renders its body; ``tojson`` is plain ``json.dumps`` (no HTML escaping, ``ensure_ascii=False``,
optional ``indent``/``separators``/``sort_keys``); globals ``raise_exception``, ``strftime_now``,
a restricted ``dict`` and a ``namespace`` that refuses underscore names.

``render`` takes the conversation already shaped the way vLLM hands it to transformers (see
``chat_request``); it drops ``None``-valued message keys and copies the reasoning text under its
three names, as transformers does, then renders with the named special tokens as variables.

``content_format`` answers vLLM's question "does this template loop over ``message.content``?"
("openai": content stays a list of parts) or not ("string": parts are joined with newlines).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, NamedTuple

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.utils
import orjson
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.features.memo_cache import MemoCache, digest

ContentFormat = Literal["string", "openai"]

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateRenderError(ValueError):
    """The template refused the conversation (``raise_exception``, a Jinja error, or a bad
    ``continue_final_message``); the message is the client's to read."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; when
    rendering a prompt it is transparent."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictBuilder:
    """``dict(...)`` and ``dict.fromkeys(...)`` in templates, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictBuilder()
    env.globals["namespace"] = _SafeNamespace
    return env


# --- content format detection (vLLM's rule: a for-loop over a message's content) ---------------


def _is_name(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` reads variable ``name`` (or its ``key`` item/attribute), possibly through filters,
    tests or slices."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_name(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable assigned from it (``{% set msgs = messages[1:] %}``)."""
    found = [name]
    queue = [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            if isinstance(assign.target, jinja2.nodes.Name) and _reads(assign.node, current):
                target = assign.target.name
                if target not in found:
                    found.append(target)
                    queue.append(target)
    return found


def _loop_targets(root: jinja2.nodes.Template, sources: Sequence[str], key: str | None) -> Iterator[str]:
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(_reads(loop.iter, s, key) for s in sources):
            yield loop.target.name


def content_format(template: str, env: ImmutableSandboxedEnvironment) -> ContentFormat:
    try:
        ast = env.parse(template)
    except jinja2.TemplateError:
        return "string"
    message_vars = list(_loop_targets(ast, _aliases(ast, "messages"), None))
    return "openai" if any(True for _ in _loop_targets(ast, message_vars, "content")) else "string"


# --- rendering -----------------------------------------------------------------------------------


def _transformers_message_view(message: Mapping[str, Any]) -> dict[str, Any]:
    msg = {k: v for k, v in message.items() if v is not None}
    reasoning = next((msg[k] for k in _REASONING_KEYS if msg.get(k) is not None), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


class RenderInputs(NamedTuple):
    """What a rendering depends on besides the template (its memo key is these, as JSON)."""

    conversation: Sequence[Mapping[str, Any]]
    tools: list[dict[str, Any]] | None
    documents: list[Any] | None
    add_generation_prompt: bool
    continue_final_message: bool
    kwargs: Mapping[str, Any]


class ChatTemplate:
    """One compiled template plus what it needs to render: the special-token variables."""

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str],
        env: ImmutableSandboxedEnvironment,
        memo: MemoCache | None = None,
    ) -> None:
        self.source = source
        # outputs remembered (memo_cache.py) unless the template reads the clock
        self._memo = memo if memo is not None and "strftime_now" not in source else None
        self._tag = digest(orjson.dumps([source, sorted(special_tokens.items())]))
        try:
            self._template = env.from_string(source)
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from None
        self._special = dict(special_tokens)
        self.content_format: ContentFormat = content_format(source, env)

    def render(
        self,
        conversation: Sequence[Mapping[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        documents: list[Any] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: Mapping[str, Any],
    ) -> str:
        """The prompt text, as transformers' ``apply_chat_template`` renders it (raises
        ``TemplateRenderError``); from the memo when these inputs were rendered before."""
        args = RenderInputs(
            conversation, tools, documents, add_generation_prompt, continue_final_message, kwargs
        )
        if self._memo is None:
            return self._render(args)
        try:
            raw = orjson.dumps(tuple(args))  # orjson refuses tuple subclasses (a NamedTuple)
        except TypeError:  # not JSON (cannot come from a request body): rendered, not kept
            return self._render(args)
        return self._memo.text(("render", self._tag, digest(raw)), lambda: self._render(args))

    def _render(self, args: RenderInputs) -> str:
        conversation, tools, documents, add_generation_prompt, continue_final_message, kwargs = args
        chat = [_transformers_message_view(m) for m in conversation]
        final_text: str | None = None
        if continue_final_message:
            if not chat:
                raise TemplateRenderError("continue_final_message is set but the conversation is empty")
            final_text = self._tag_final(chat)
        variables = {**self._special, **kwargs}
        try:
            rendered = self._template.render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise TemplateRenderError(str(exc)) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
            raise TemplateRenderError(f"chat template failed: {exc}") from None
        if final_text is not None:
            rendered = self._cut_at_tag(rendered, final_text)
        return rendered

    @staticmethod
    def _tag_final(chat: list[dict[str, Any]]) -> str:
        last = dict(chat[-1])
        final = last.get("content")
        if final is None:
            raise TemplateRenderError('continue_final_message is set but the final message has no "content"')
        if isinstance(final, list):
            parts = [dict(p) if isinstance(p, Mapping) else p for p in final]
            for part in reversed(parts):
                if isinstance(part, dict) and "text" in part:
                    text = str(part["text"])
                    part["text"] = text + _CONTINUE_TAG
                    last["content"] = parts
                    chat[-1] = last
                    return text
            raise TemplateRenderError("continue_final_message is set but the final message has no text")
        text = str(final)
        last["content"] = text + _CONTINUE_TAG
        chat[-1] = last
        return text

    @staticmethod
    def _cut_at_tag(rendered: str, final_text: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or tag not in rendered:
            raise TemplateRenderError(
                "continue_final_message is set but the final message does not appear in the rendered chat"
            )
        loc = rendered.rindex(tag)
        if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:loc]
        return rendered[:loc].rstrip()
