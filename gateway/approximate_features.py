"""Routing features without a tokenizer: block keys over characters.

Used by the app for models whose features the tokenizer-based featurizer cannot provide. The
prompt text (the completion ``prompt``, or the chat ``messages`` serialised role by role) is cut
into blocks of ``char_block_size`` characters and keyed with the same chained xxh3 as token
blocks (each character's code point standing for a token id). The keys only ever match other
requests keyed this way, so they steer affinity but predict no engine cache hit: the predicted
cached tokens are those blocks counted in characters, and the prediction audit shows the drift.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.openai_errors import RequestRejected
from router_policies.block_keys import block_keys
from router_policies.policy import RequestFeatures


def prompt_text(endpoint: str, body: Mapping[str, Any]) -> str:
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestRejected(400, "'messages' must be a non-empty list", param="messages")
        parts: list[str] = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise RequestRejected(400, f"messages[{i}] must be an object", param=f"messages.{i}")
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(
                    str(c.get("text", "")) for c in content if isinstance(c, dict) and c.get("type") == "text"
                )
            parts.append(f"\x00{m.get('role', '')}\x00{content if content is not None else ''}")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return "".join(chr(min(int(t), 0x10FFFF)) for t in prompt)
    raise RequestRejected(400, "'prompt' must be a string or a list of token ids", param="prompt")


class CharBlockFeaturizer:
    def __init__(self, char_block_size: Mapping[str, int], default_block: int, session_header: str) -> None:
        self._blocks = dict(char_block_size)
        self._default = default_block
        self._session_header = session_header

    async def __call__(
        self, endpoint: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> RequestFeatures:
        model = str(body["model"])
        text = prompt_text(endpoint, body)
        size = self._blocks.get(model, self._default)
        lora = body.get("lora") if isinstance(body.get("lora"), str) else None
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        keys = block_keys([ord(c) for c in text[: len(text) - len(text) % size]], size, model, lora, salt)
        return RequestFeatures(
            model=model,
            block_keys=keys,
            prompt_tokens=len(text),
            block_size=size,
            session_id=headers.get(self._session_header),
        )
