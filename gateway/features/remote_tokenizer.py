"""``tokenizer: remote``: ask a replica's vLLM-compatible ``/tokenize`` for the prompt's ids.

The caller decides which replica: a fixed base URL, or a callable ``model -> base URL | None``
(e.g. "any healthy replica serving it"). The request carries the body's own prompt fields, so the
engine renders and encodes exactly as it will for the real request. The aiohttp session belongs
to this object and is closed by ``close()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

UrlChooser = str | Callable[[str], str | None]

_CHAT_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "tools",
    "chat_template_kwargs",
    "documents",
    "reasoning_effort",
)
_COMPLETION_FIELDS = ("prompt", "add_special_tokens")


class RemoteTokenizeError(Exception):
    """The replica could not tokenize (no replica, network error, timeout, bad answer)."""


class RemoteTokenizer:
    def __init__(self, chooser: UrlChooser) -> None:
        self._chooser = chooser
        self._session: aiohttp.ClientSession | None = None

    def _url(self, model: str) -> str:
        base = self._chooser if isinstance(self._chooser, str) else self._chooser(model)
        if not base:
            raise RemoteTokenizeError(f"no replica to ask for /tokenize of {model!r}")
        return base.rstrip("/") + "/tokenize"

    async def tokenize(
        self, kind: str, base_model: str, model: str, body: Mapping[str, Any], timeout_s: float
    ) -> list[int]:
        """Tokens of ``body``'s prompt from a replica serving ``base_model``; ``model`` (the name
        the request used, maybe a LoRA adapter) is what the replica is asked about."""
        fields = _CHAT_FIELDS if kind == "chat" else _COMPLETION_FIELDS
        payload: dict[str, Any] = {"model": model}
        payload.update({k: body[k] for k in fields if k in body})
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.post(
                self._url(base_model), json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status != 200:
                    raise RemoteTokenizeError(f"/tokenize answered {resp.status}")
                data = await resp.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RemoteTokenizeError(f"/tokenize failed: {exc!r}") from None
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise RemoteTokenizeError("/tokenize answered without a list of token ids")
        return tokens

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
