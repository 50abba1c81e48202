"""Each generation request's arrival at the simulated engine's HTTP handler and the end of its
parse (validation and tokenization), one JSON line a request (``kvgate sim-engine
--request-log PATH``), for the live bench's inbound hop (bench/live_hop.py).

A router's client-side TTFT is its own hop in, the engine's queue before the request is
scheduled (its tokenizer thread, one per engine as in vLLM's OpenAI server), the engine's TTFT,
and the hop out. The engines' histograms give the TTFT alone; with the time the client sent the
same prompt, this log tells the hop in (client send -> engine handler) from the engine's
parse queue (handler -> parsed), per request and for any router, with no help from the router.

Lines: ``{"arrived": s, "parsed": s, "key": int}``, times on ``time.monotonic`` (the host's
monotonic clock, which the bench's client reads too); ``key`` is ``prompt_key`` of the body.
Bounded: at most ``max_lines`` lines, then nothing more is written (counted in ``skipped``).
Each line is written as it comes (line-buffered), so the file is whole while the engine runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import orjson
import xxhash

MAX_LINES = 1_000_000  # ~60 bytes a line: at most ~60 MB


def prompt_key(body: Any) -> int | None:
    """The key a request is matched by across processes: xxh3-64 of a completion's prompt text,
    or of a chat request's messages as JSON with sorted keys; None for anything else (a prompt
    of token ids, a malformed body)."""
    if not isinstance(body, dict):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return xxhash.xxh3_64_intdigest(prompt.encode("utf-8", "surrogatepass"))
    messages = body.get("messages")
    if isinstance(messages, list):
        return xxhash.xxh3_64_intdigest(orjson.dumps(messages, option=orjson.OPT_SORT_KEYS))
    return None


class RequestLog:
    """Appends to ``path`` (created, or truncated, at the first line). Single writer: the
    engine's event loop."""

    def __init__(self, path: Path, max_lines: int = MAX_LINES) -> None:
        assert max_lines >= 0
        self.path = path
        self.max_lines = max_lines
        self.lines = 0
        self.skipped = 0
        self._file: IO[str] | None = None

    def record(self, arrived: float, parsed: float, body: Any) -> None:
        """A request that reached the handler at ``arrived`` and was parsed at ``parsed``."""
        key = prompt_key(body)
        if key is None:
            return
        if self.lines >= self.max_lines:
            self.skipped += 1
            return
        if self._file is None:
            self._file = self.path.open("w", buffering=1, encoding="utf-8")
        self._file.write(f'{{"arrived": {arrived:.6f}, "parsed": {parsed:.6f}, "key": {key}}}\n')
        self.lines += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
