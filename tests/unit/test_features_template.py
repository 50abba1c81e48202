"""Chat-template rendering equals ``transformers.apply_chat_template`` on what the corpus does not
reach: other templates (content loops, tool_use selection, namespaces, ``tojson`` options,
``{% generation %}``, loop controls), ``continue_final_message``, documents, template kwargs,
reasoning fields, None-valued keys, and vLLM's rewriting of tools and tool calls."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from gateway.config import ModelConfig
from gateway.features import EncodeSettings, Featurizer
from gateway.features.chat_template import content_format, make_environment
from gateway.request_errors import InvalidRequestError

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
logging.getLogger("transformers").setLevel(logging.ERROR)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "assets/tokenizers/kvgate-tiny"

# a template exercising what real ones use: content loops (-> "openai" format), namespace, tojson
# with indent, loop controls, generation tags, reasoning, tool calls, documents, a custom kwarg
RICH_TEMPLATE = """{%- set ns = namespace(first=true) -%}
{%- if tools %}<|im_start|>system
Tools:
{{ tools | tojson(indent=2) }}
{% endif -%}
{%- if documents %}{% for d in documents %}[doc {{ loop.index }}] {{ d.title }}: {{ d.text }}
{% endfor %}{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'skip' %}{% continue %}{% endif -%}
<|im_start|>{{ message.role }}{% if message.name is defined %} ({{ message.name }}){% endif %}
{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}|{% endfor %}{% endif %}
{%- if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
{%- if message.tool_calls is defined %}{% for c in message.tool_calls %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}{% endif %}
{%- if message.role == 'assistant' %}{% generation %} done{% endgeneration %}{% endif %}<|im_end|>
{% set ns.first = false %}{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}{{ custom_suffix | default('') }}{% endif -%}
"""


def make_folder(tmp_path: Path, template: str | list[dict[str, str]]) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(TINY / "tokenizer.json", folder / "tokenizer.json")
    cfg = json.loads((TINY / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def featurizer(folder: Path) -> Featurizer:
    return Featurizer(
        [ModelConfig(name="m", tokenizer=str(folder))], EncodeSettings(cache_entries=1000, threads=1)
    )


def reference_ids(folder: Path, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    from transformers import PreTrainedTokenizerFast

    tok: Any = PreTrainedTokenizerFast.from_pretrained(str(folder))
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    return list(tok.encode(text, add_special_tokens=False))


def ids(fz: Featurizer, body: dict[str, Any]) -> list[int]:
    _, info = fz.features_sync("chat", {"model": "m", **body})
    assert info.token_ids is not None
    return list(info.token_ids.tolist())


def test_content_format_detection() -> None:
    env = make_environment()
    assert content_format(RICH_TEMPLATE, env) == "openai"
    assert content_format((TINY / "tokenizer_config.json").read_text(), env) == "string"
    aliased = "{% set msgs = messages[1:] %}{% for m in msgs %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}"
    assert content_format(aliased, env) == "openai"
    assert content_format("{% for m in messages %}{{ m.content }}{% endfor %}", env) == "string"


def test_rich_template_matches_transformers(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, RICH_TEMPLATE)
    fz = featurizer(folder)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "sys ✓", "name": "boss"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b 日本"}]},
        {"role": "skip", "content": "never shown"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "thinking…",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1, "y": "é"}'}}
            ],
        },
        {
            "role": "tool",
            "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
            "tool_call_id": "c1",
        },
        {"role": "user", "content": "again"},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "description": "does f", "parameters": {"type": "object"}},
        }
    ]
    documents = [{"title": "T1", "text": "body one"}, {"title": "T2", "text": "body two"}]
    body = {
        "messages": messages,
        "tools": tools,
        "documents": documents,
        "reasoning_effort": "low",
        "chat_template_kwargs": {"custom_suffix": "SUFFIX", "unused_var": 1},
    }
    # what vLLM hands transformers: content as text parts (openai format), tool content joined,
    # null content as no parts, arguments parsed, reasoning under both names, enable_thinking
    vllm_messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": "sys ✓"}], "name": "boss"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b 日本"}]},
        {"role": "skip", "content": [{"type": "text", "text": "never shown"}]},
        {
            "role": "assistant",
            "content": [],
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1, "y": "é"}}}
            ],
            "reasoning": "thinking…",
            "reasoning_content": "thinking…",
        },
        {"role": "tool", "content": "r1\nr2", "tool_call_id": "c1"},
        {"role": "user", "content": [{"type": "text", "text": "again"}]},
    ]
    want = reference_ids(
        folder,
        vllm_messages,
        tools=tools,
        documents=documents,
        add_generation_prompt=True,
        custom_suffix="SUFFIX",
        enable_thinking=True,
    )
    assert ids(fz, body) == want


def test_continue_final_message_matches_transformers(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, json.loads((TINY / "tokenizer_config.json").read_text())["chat_template"])
    fz = featurizer(folder)
    messages = [
        {"role": "user", "content": "Write a haiku"},
        {"role": "assistant", "content": "Autumn moon  "},
    ]
    want = reference_ids(folder, messages, continue_final_message=True)
    got = ids(fz, {"messages": messages, "add_generation_prompt": False, "continue_final_message": True})
    assert got == want
    with pytest.raises(InvalidRequestError) as err:
        fz.features_sync("chat", {"model": "m", "messages": messages, "continue_final_message": True})
    assert err.value.param == "continue_final_message"


def test_tool_use_template_selected_only_with_tools(tmp_path: Path) -> None:
    folder = make_folder(
        tmp_path,
        [
            {"name": "default", "template": "{% for m in messages %}D:{{ m.content }}{% endfor %}"},
            {
                "name": "tool_use",
                "template": "{% for m in messages %}T:{{ m.content }}{{ tools | length }}{% endfor %}",
            },
        ],
    )
    fz = featurizer(folder)
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    assert ids(fz, {"messages": msgs}) == reference_ids(folder, msgs)
    assert ids(fz, {"messages": msgs, "tools": tools}) == reference_ids(folder, msgs, tools=tools)
    assert ids(fz, {"messages": msgs}) != ids(fz, {"messages": msgs, "tools": tools})


def test_tools_are_normalized_like_vllm(tmp_path: Path) -> None:
    """A tool without description/parameters reaches the template as vLLM's pydantic dump of it."""
    folder = make_folder(
        tmp_path, "{% for t in tools %}{{ t | tojson }}{% endfor %}{{ messages[0].content }}"
    )
    fz = featurizer(folder)
    msgs = [{"role": "user", "content": "x"}]
    given = [{"function": {"name": "f", "strict": True}, "type": "function"}]
    dumped = [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": None, "strict": True},
        }
    ]
    assert ids(fz, {"messages": msgs, "tools": given}) == reference_ids(folder, msgs, tools=dumped)


def test_chat_template_jinja_file_and_config_override(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, "CONFIG {{ messages[0].content }}")
    (folder / "chat_template.jinja").write_text("FILE {{ messages[0].content }}")
    msgs = [{"role": "user", "content": "hello"}]
    assert ids(featurizer(folder), {"messages": msgs}) == reference_ids(folder, msgs)
    override = tmp_path / "override.jinja"
    override.write_text("OVERRIDE {{ messages[0].content }}")
    fz = Featurizer(
        [ModelConfig(name="m", tokenizer=str(folder), chat_template=str(override))],
        EncodeSettings(cache_entries=10),
    )
    tok = fz.features_sync("chat", {"model": "m", "messages": msgs})[1].token_ids
    assert tok is not None
    from transformers import PreTrainedTokenizerFast

    ref: Any = PreTrainedTokenizerFast.from_pretrained(str(folder))
    assert tok.tolist() == ref.encode("OVERRIDE hello", add_special_tokens=False)


def test_strftime_now_and_raise_exception(tmp_path: Path) -> None:
    folder = make_folder(
        tmp_path,
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
        "{{ strftime_now('%Y') | length }}{{ messages[0].content }}{{ bos_token or '' }}{{ eos_token }}",
    )
    fz = featurizer(folder)
    msgs = [{"role": "user", "content": "hi"}]
    assert ids(fz, {"messages": msgs}) == reference_ids(folder, msgs)
    with pytest.raises(InvalidRequestError) as err:
        fz.features_sync("chat", {"model": "m", "messages": [{"role": "system", "content": "s"}]})
    assert err.value.param == "messages" and "first message must be from the user" in err.value.message


def test_sandbox_refuses_unsafe_access(tmp_path: Path) -> None:
    folder = make_folder(tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        featurizer(folder).features_sync(
            "chat", {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        )
    folder2 = make_folder(tmp_path / "b", "{% set ns = namespace(_x=1) %}{{ messages[0].content }}")
    with pytest.raises(InvalidRequestError):
        featurizer(folder2).features_sync(
            "chat", {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        )
