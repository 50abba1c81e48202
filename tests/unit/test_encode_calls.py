"""gateway/features/encode_calls.py: ``encode`` on an event loop's thread, ``encode_batch`` off it,
the same encodings either way."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gateway.features.encode_calls import encode_many, encode_one, on_event_loop
from gateway.features.tokenizer_files import load_tokenizer_files

TINY = Path(__file__).resolve().parents[2] / "assets" / "tokenizers" / "kvgate-tiny"
TEXTS = ["Hello, world.", "  two  spaces and a tab\t", "", "<|im_end|> added token", "é ü 東京"]


def _recording() -> tuple[Any, list[str]]:
    tok = load_tokenizer_files(TINY, where="t").tokenizer
    calls: list[str] = []

    def encode(text: str, **kw: Any) -> Any:
        calls.append("encode")
        return tok.encode(text, **kw)

    def encode_batch(texts: list[str], **kw: Any) -> Any:
        calls.append("encode_batch")
        return tok.encode_batch(texts, **kw)

    return SimpleNamespace(encode=encode, encode_batch=encode_batch), calls


def _both(tok: Any) -> list[tuple[list[int], list[tuple[int, int]], list[int | None]]]:
    out = [encode_one(tok, t, add_special_tokens=s) for t in TEXTS for s in (False, True)]
    out += encode_many(tok, TEXTS, add_special_tokens=False)
    return [(e.ids, e.offsets, e.word_ids) for e in out]


def test_on_the_event_loop_encode_off_it_encode_batch_the_same_encodings() -> None:
    tok, calls = _recording()
    off: list[Any] = []
    worker = threading.Thread(target=lambda: off.extend(_both(tok)))
    worker.start()
    worker.join()
    assert set(calls) == {"encode_batch"} and not on_event_loop()

    async def on_loop() -> list[Any]:
        assert on_event_loop()
        return _both(tok)

    calls.clear()
    on = asyncio.run(on_loop())
    assert set(calls) == {"encode"}
    assert on == off and len(on) == 3 * len(TEXTS)
