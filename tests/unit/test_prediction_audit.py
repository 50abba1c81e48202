"""Reading the engine's cached-token report (``request_outcome.usage_in``, which the upstream
calls once per answer for the audit and the operator view) within a bounded tail."""

from __future__ import annotations

import json

from gateway.prediction_audit import SseTail
from gateway.request_outcome import usage_in


def cached_tokens_in_body(body: bytes) -> int | None:
    use = usage_in(body, False)
    return None if use is None else use.reported_cached


def cached_tokens_in_sse_tail(tail: bytes) -> int | None:
    use = usage_in(tail, True)
    return None if use is None else use.reported_cached


def _event(doc: object) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


USAGE = {"usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}


def test_body_and_stream_reports() -> None:
    assert cached_tokens_in_body(json.dumps({"id": "x", **USAGE}).encode()) == 32
    assert cached_tokens_in_body(b'{"usage": {"prompt_tokens": 3}}') is None
    assert cached_tokens_in_body(b"not json") is None
    stream = (
        _event({"choices": [{"text": "a"}], "usage": None})
        + _event({"choices": [], **USAGE})
        + b"data: [DONE]\n\n"
    )
    assert cached_tokens_in_sse_tail(stream) == 32
    assert cached_tokens_in_sse_tail(stream.replace(b"\n", b"\r\n")) == 32
    assert cached_tokens_in_sse_tail(_event({"choices": [{"text": '"usage"'}]})) is None


def test_tail_is_bounded_and_keeps_the_last_bytes() -> None:
    tail = SseTail(b"x" * 5000, limit=1000)
    assert len(tail) == 1000
    final = _event({"choices": [], **USAGE}) + b"data: [DONE]\n\n"
    for _ in range(500):
        tail.feed(_event({"choices": [{"text": "token"}], "usage": None}))
        assert len(tail) <= 2000
    tail.feed(final)
    assert len(tail) <= 2000
    assert tail.value().endswith(final)
    assert cached_tokens_in_sse_tail(tail.value()) == 32
