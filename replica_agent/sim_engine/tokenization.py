"""Tokenization exactly as vLLM does it, with ``transformers`` and nothing of kvgate's own.

This is the independent reference the gateway's tokenizer and chat-template code is checked
against, so it must follow vLLM's path, not ours:
- completions: ``tokenizer(prompt, add_special_tokens=True)`` (a prompt may also be token ids,
  used as they are);
- chat: ``apply_chat_template(messages, tools=..., add_generation_prompt=..., tokenize=False)`` then
  ``encode(text, add_special_tokens=False)`` (the template already placed the special tokens).

Generated text is made of "safe" tokens only: ids whose own decoding is printable ASCII, so that
streaming deltas decode token by token without splitting a UTF-8 sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash
from transformers import PreTrainedTokenizerFast

_MAX_SAFE_TOKENS = 4096


class EngineTokenizer:
    def __init__(self, directory: Path) -> None:
        self._tok: Any = PreTrainedTokenizerFast.from_pretrained(str(directory))
        self.vocab_size: int = len(self._tok)
        special = set(self._tok.all_special_ids)
        safe: list[int] = []
        for tid in range(self.vocab_size):
            if tid in special:
                continue
            text = self._tok.decode([tid])
            if text and text.isascii() and text.isprintable():
                safe.append(tid)
            if len(safe) >= _MAX_SAFE_TOKENS:
                break
        if not safe:
            raise ValueError(f"tokenizer {directory} has no token that decodes to printable ASCII")
        self._safe = safe

    def encode_prompt(self, prompt: str) -> list[int]:
        ids: list[int] = self._tok(prompt, add_special_tokens=True)["input_ids"]
        return ids

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        text: str = self._tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
        return text

    def encode_chat_text(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False)
        return ids

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        strs: list[str] = self._tok.convert_ids_to_tokens(list(ids))
        return strs

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tok.decode(list(ids))
        return text

    def pseudo_tokens(self, seed: int, prompt: Sequence[int], count: int) -> list[int]:
        """``count`` deterministic output token ids for this prompt and seed (same inputs, same
        output, in every process)."""
        h = xxhash.xxh3_64_intdigest(repr((seed, len(prompt), tuple(prompt[-64:]))).encode())
        n = len(self._safe)
        out: list[int] = []
        for i in range(count):
            h = xxhash.xxh3_64_intdigest(h.to_bytes(8, "little") + i.to_bytes(8, "little"))
            out.append(self._safe[h % n])
        return out
