"""What an engine's ``GET /v1/models`` says it serves (docs/agent.md, "Adapters").

vLLM lists its base model(s) and one entry per loaded LoRA adapter; an adapter's entry names the
base model in ``parent`` (``root`` is the adapter's path), a base model's ``parent`` is null
(vllm/entrypoints/openai/serving_models.py, ``show_available_models``). The list changes when an
adapter is loaded or unloaded (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, or on
demand by a resolver plugin), so the agent polls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proto.contract import MAX_LORA_ADAPTERS


@dataclass(frozen=True, slots=True)
class EngineModels:
    models: tuple[str, ...]  # base models, in the engine's order
    adapters: frozenset[str]  # LoRA adapters loaded now (at most MAX_LORA_ADAPTERS)


def engine_models(doc: Any) -> EngineModels:
    """The base models and LoRA adapters of a ``/v1/models`` answer (raises ``ValueError`` when
    it is not one). An entry with a ``parent`` is an adapter; beyond MAX_LORA_ADAPTERS adapters
    the rest are left out (sorted by name, so the choice is stable)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise ValueError("/v1/models: no data list")
    models: list[str] = []
    adapters: list[str] = []
    for m in doc["data"]:
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            continue
        (adapters if m.get("parent") else models).append(m["id"])
    return EngineModels(tuple(models), frozenset(sorted(adapters)[:MAX_LORA_ADAPTERS]))
