"""Bad requests get a clear error naming the parameter: unknown model 404, everything else 400."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config import ModelConfig
from gateway.features import EncodeSettings, FeatureConfigError, Featurizer
from gateway.openai_errors import RequestError
from gateway.request_errors import InvalidRequestError, UnknownModelError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "assets/tokenizers/kvgate-tiny")
OK_MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fz() -> Featurizer:
    return Featurizer(
        [
            ModelConfig(name="tiny", tokenizer=TINY, lora_adapters=["tiny-lora"]),
            ModelConfig(name="chars", tokenizer=None),
        ],
        EncodeSettings(cache_entries=100),
    )


def test_unknown_model_is_404(fz: Featurizer) -> None:
    with pytest.raises(UnknownModelError) as err:
        fz.features_sync("chat", {"model": "nope", "messages": OK_MESSAGES})
    e = err.value
    assert (e.status, e.param, e.code, e.type) == (404, "model", "model_not_found", "not_found_error")
    assert e.to_dict() == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert isinstance(e, RequestError)  # the proxy's handler answers it


CHAT_CASES: list[tuple[dict[str, Any], str]] = [
    ({}, "model"),
    ({"model": 3, "messages": OK_MESSAGES}, "model"),
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": "hi"}, "messages"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": ["hi"]}, "messages[0]"),
    ({"model": "tiny", "messages": [{"content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": [OK_MESSAGES[0], {"role": "user", "content": 5}]}, "messages[1].content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [7]}]}, "messages[0].content[0]"),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": [{"text": "x"}]}]},
        "messages[0].content[0].type",
    ),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content[0].text",
    ),
    (
        {"model": "tiny", "messages": [{"role": "assistant", "content": "", "tool_calls": [1]}]},
        "messages[0].tool_calls[0]",
    ),
    ({"model": "tiny", "messages": OK_MESSAGES, "tools": {}}, "tools"),
    ({"model": "tiny", "messages": OK_MESSAGES, "tools": [{"type": "function"}]}, "tools[0].function"),
    (
        {"model": "tiny", "messages": OK_MESSAGES, "tools": [{"function": {"name": 1}}]},
        "tools[0].function.name",
    ),
    ({"model": "tiny", "messages": OK_MESSAGES, "add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"model": "tiny", "messages": OK_MESSAGES, "chat_template_kwargs": []}, "chat_template_kwargs"),
    (
        {"model": "tiny", "messages": OK_MESSAGES, "chat_template_kwargs": {"tokenize": True}},
        "chat_template_kwargs",
    ),
    ({"model": "tiny", "messages": OK_MESSAGES, "cache_salt": ""}, "cache_salt"),
    ({"model": "tiny", "messages": OK_MESSAGES, "cache_salt": 5}, "cache_salt"),
    ({"model": "tiny", "messages": OK_MESSAGES, "documents": "d"}, "documents"),
    ({"model": "tiny", "messages": OK_MESSAGES, "truncate_prompt_tokens": "3"}, "truncate_prompt_tokens"),
    ({"model": "chars", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_CASES)
def test_bad_chat_bodies_are_400_naming_the_param(fz: Featurizer, body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        fz.features_sync("chat", body)
    assert err.value.status == 400
    assert err.value.param == param
    assert err.value.to_dict()["error"]["type"] == "invalid_request_error"


COMPLETION_CASES: list[tuple[dict[str, Any], str]] = [
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": {"text": "x"}}, "prompt"),
    ({"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "tiny", "prompt": [[1, 2], [3]]}, "prompt"),
    ({"model": "tiny", "prompt": []}, "prompt"),
    ({"model": "tiny", "prompt": [1, -2]}, "prompt"),
    ({"model": "tiny", "prompt": [1, True]}, "prompt"),
    ({"model": "tiny", "prompt": [5, 999_999]}, "prompt"),  # out of vocabulary
    ({"model": "tiny", "prompt": "x", "add_special_tokens": 1}, "add_special_tokens"),
    ({"model": "tiny", "prompt": "x", "truncation_side": "middle"}, "truncation_side"),
    ({"model": "chars", "prompt": 3}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), COMPLETION_CASES)
def test_bad_completion_bodies_are_400_naming_the_param(
    fz: Featurizer, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        fz.features_sync("completions", body)
    assert (err.value.status, err.value.param) == (400, param)


def test_non_object_body_is_400(fz: Featurizer) -> None:
    with pytest.raises(RequestError) as err:
        fz.features_sync("chat", ["not", "an", "object"])  # type: ignore[arg-type]
    assert err.value.status == 400


def test_bad_configs_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(FeatureConfigError, match=r"models\[0\]\.tokenizer"):
        Featurizer([ModelConfig(name="m", tokenizer=str(tmp_path))], EncodeSettings(cache_entries=1))
    with pytest.raises(FeatureConfigError, match=r"models\[0\]\.tokenizer: 'remote'"):
        Featurizer([ModelConfig(name="m", tokenizer="remote")], EncodeSettings(cache_entries=1))
    with pytest.raises(FeatureConfigError, match=r"models\[1\]\.lora_adapters"):
        Featurizer(
            [ModelConfig(name="a"), ModelConfig(name="b", lora_adapters=["a"])],
            EncodeSettings(cache_entries=1),
        )
    with pytest.raises(FeatureConfigError, match=r"models\[0\]\.chat_template"):
        Featurizer(
            [ModelConfig(name="m", tokenizer=TINY, chat_template=str(tmp_path / "none.jinja"))],
            EncodeSettings(cache_entries=1),
        )
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(FeatureConfigError, match=r"models\[0\]\.tokenizer: cannot load"):
        Featurizer([ModelConfig(name="m", tokenizer=str(tmp_path))], EncodeSettings(cache_entries=1))


def test_model_without_chat_template_refuses_chat(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((Path(TINY) / "tokenizer.json").read_text())
    fz = Featurizer([ModelConfig(name="m", tokenizer=str(tmp_path))], EncodeSettings(cache_entries=1))
    with pytest.raises(InvalidRequestError) as err:
        fz.features_sync("chat", {"model": "m", "messages": OK_MESSAGES})
    assert err.value.param == "messages"
    features, _ = fz.features_sync("completions", {"model": "m", "prompt": "fine"})
    assert features.prompt_tokens > 0
