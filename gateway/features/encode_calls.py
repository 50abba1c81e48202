"""The tokenizer call an encode makes, by the thread it runs on (docs/performance.md, "The event
loop's encodes keep the GIL").

``tokenizers`` releases the GIL in ``encode_batch`` and holds it for the whole of ``encode``:

* Off the event loop's thread (the request path's worker pool, the deferred encoder):
  ``encode_batch``, so that the event loop runs while the worker encodes (an 8 KB text holds the
  GIL ~3 ms in ``encode``).
* On a thread running an event loop: ``encode``. Releasing the GIL there frees nothing the loop
  needs (its own thread is the one encoding), and it lets a background thread's Python take the
  GIL, which the loop must then wait to get back after its encode is done: up to the
  interpreter's switch interval (5 ms). Measured with the deferred encoder's kind of work on a
  second thread, a 338-character head took 1.1-1.4 ms at the p99 through ``encode_batch``,
  0.28-0.32 ms through ``encode`` (p50 alike).

Both calls give the same ``Encoding`` for a text (tests/unit/test_encode_calls.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tokenizers import Encoding, Tokenizer


def on_event_loop() -> bool:
    """Whether this thread is running an event loop (the request path's own thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def encode_one(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool) -> Encoding:
    if on_event_loop():
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def encode_many(tokenizer: Tokenizer, texts: Sequence[str], *, add_special_tokens: bool) -> list[Encoding]:
    if on_event_loop():
        return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    return tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
