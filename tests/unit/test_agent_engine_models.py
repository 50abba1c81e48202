"""The agent's reading of an engine's /v1/models: base models and loaded LoRA adapters (vLLM
lists an adapter with ``parent`` = its base model, serving_models.py ``show_available_models``)."""

from __future__ import annotations

import pytest

from proto.contract import MAX_LORA_ADAPTERS
from replica_agent.engine_models import engine_models


def card(mid: str, parent: str | None = None) -> dict[str, object]:
    return {"id": mid, "object": "model", "owned_by": "vllm", "root": f"/models/{mid}", "parent": parent}


def test_base_models_and_adapters() -> None:
    doc = {
        "object": "list",
        "data": [card("tiny-llama"), card("sql", "tiny-llama"), card("chat", "tiny-llama")],
    }
    got = engine_models(doc)
    assert got.models == ("tiny-llama",)
    assert got.adapters == {"sql", "chat"}
    assert engine_models({"data": [card("m")]}).adapters == frozenset()  # SGLang, sim: no parent


def test_malformed_answers() -> None:
    with pytest.raises(ValueError):
        engine_models({"object": "list"})
    with pytest.raises(ValueError):
        engine_models([])
    assert engine_models({"data": [{"id": 3}, "x", card("m")]}).models == ("m",)


def test_adapters_are_bounded_by_the_contract() -> None:
    doc = {"data": [card("m"), *(card(f"a{i:05d}", "m") for i in range(MAX_LORA_ADAPTERS + 5))]}
    got = engine_models(doc)
    assert len(got.adapters) == MAX_LORA_ADAPTERS
    assert "a00000" in got.adapters and f"a{MAX_LORA_ADAPTERS:05d}" not in got.adapters
