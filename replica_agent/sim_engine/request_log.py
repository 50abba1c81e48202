"""Each generation request's arrival at the simulated engine's HTTP handler, the end of its
parse (validation and tokenization) and the write of its first token, one JSON line a request
(``kvgate sim-engine --request-log PATH``), for the live bench's hops (bench/live_hop.py).

A router's client-side TTFT is its own hop in, the engine's queue before the request is
scheduled (its tokenizer thread, one per engine as in vLLM's OpenAI server), the engine's own
time to the first token, and the hop out. The engines' histograms give the engine's part alone;
with the times the client sent the same prompt and read its first token, this log tells each
stage apart, per request and for any router, with no help from the router: the hop in (client
send -> engine handler), the parse queue (handler -> parsed), the engine (parsed -> first token
written) and the hop out (first token written -> client's first data).

Lines: ``{"arrived": s, "parsed": s, "first": s or null, "key": int, "cached": int or null}``,
times on ``time.monotonic`` (the host's monotonic clock, which the bench's client reads too);
``first`` is null for a request that wrote no token (an error, a non-streamed answer, a client
gone); ``key`` is ``prompt_key`` of the body; ``cached`` is the prompt tokens the engine served
from its prefix cache (what its usage reports as ``cached_tokens``), null for a request whose
prefill was never scheduled. Per request, so that a difference in the engine-counted hit rate
between two routers can be traced to the requests that make it (docs/performance.md, "The
synthetic trace's hit rate, request by request"). A line is written when its request's handler ends.
Bounded: at most ``max_lines`` lines, then nothing more is written (counted in ``skipped``).
Each line is written as it comes (line-buffered), so the file is whole while the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(slots=True)
class Stamps:
    """One request's times on ``time.monotonic``, noted by the handler as they happen."""

    key: int | None  # ``prompt_key`` of its body (None: not logged)
    arrived: float
    parsed: float = 0.0
    first: float | None = None  # its first token written to the client
    cached: int | None = None  # its prompt tokens served from the prefix cache, once prefilled

    def first_token(self, now: float) -> None:
        if self.first is None:
            self.first = now


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

    def record(self, stamps: Stamps) -> None:
        """A request whose handler has ended (nothing for a body with no key)."""
        if stamps.key is None:
            return
        if self.lines >= self.max_lines:
            self.skipped += 1
            return
        if self._file is None:
            self._file = self.path.open("w", buffering=1, encoding="utf-8")
        first = "null" if stamps.first is None else f"{stamps.first:.6f}"
        cached = "null" if stamps.cached is None else str(stamps.cached)
        self._file.write(
            f'{{"arrived": {stamps.arrived:.6f}, "parsed": {stamps.parsed:.6f}, "first": {first}, '
            f'"key": {stamps.key}, "cached": {cached}}}\n'
        )
        self.lines += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
