"""The malformed HTTP requests of ``make faults`` (docs/faults.md): parser-level (what aiohttp's
parser refuses before any handler runs) and application-level (valid HTTP, bad OpenAI requests,
wrong methods and paths, oversize bodies). Each is sent on its own connection; the answer must be a
2xx or an OpenAI-shaped JSON error.
"""

from __future__ import annotations

import json

MODEL = "kvgate-tiny"


def post(path: str, body: bytes, extra: bytes = b"", ctype: bytes = b"application/json") -> bytes:
    return (
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: " + ctype + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"Connection: close\r\n\r\n" + body
    )


def chat(doc: object) -> bytes:
    return post("/v1/chat/completions", json.dumps(doc).encode())


def completion(doc: object) -> bytes:
    return post("/v1/completions", json.dumps(doc).encode())


def get(path: str, extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + extra + b"Connection: close\r\n\r\n"


MSG = [{"role": "user", "content": "hi"}]
MANY_HEADERS = b"".join(b"X-H%d: v\r\n" % i for i in range(300))
CHUNKED = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Transfer-Encoding: chunked\r\n"
)

PARSER: list[tuple[str, bytes]] = [
    ("garbage request line", b"GARBAGE\r\n\r\n"),
    ("bad HTTP version", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n"),
    ("HTTP/0.9 request", b"GET /\r\n\r\n"),
    ("too many headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" + MANY_HEADERS + b"\r\n"),
    ("64 KB header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n"),
    ("64 KB URL", b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("TE with CL", CHUNKED.replace(b"Transfer", b"Content-Length: 5\r\nTransfer") + b"\r\n0\r\n\r\n"),
    ("bad chunk size", CHUNKED + b"\r\nzz\r\n{}\r\n0\r\n\r\n"),
    ("chunk without CRLF", CHUNKED + b"\r\n2\r\n{}XX0\r\n\r\n"),
    (
        "negative Content-Length",
        post("/v1/completions", b"{}").replace(b"Content-Length: 2", b"Content-Length: -2"),
    ),
    (
        "non-numeric Content-Length",
        post("/v1/completions", b"{}").replace(b"Content-Length: 2", b"Content-Length: 2x"),
    ),
    ("two Content-Lengths", post("/v1/completions", b"{}", extra=b"Content-Length: 7\r\n")),
    ("header without colon", b"GET /health HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n"),
    ("space in header name", b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n"),
    ("NUL in header value", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n"),
    ("bad method chars", b"G@T /health HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("unknown Transfer-Encoding", CHUNKED.replace(b"chunked", b"foo") + b"\r\n{}"),
    ("gzip then chunked", CHUNKED.replace(b"chunked", b"gzip, chunked") + b"\r\n2\r\n{}\r\n0\r\n\r\n"),
    ("CR alone in header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n"),
    ("obsolete line folding", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n  folded\r\n\r\n"),
    ("huge chunk size", CHUNKED + b"\r\nffffffffffffffff\r\n{}\r\n0\r\n\r\n"),
    (
        "body shorter than Content-Length",
        post("/v1/completions", b"{}").replace(b"Length: 2", b"Length: 200"),
    ),
    ("binary junk", bytes(range(256)) * 4),
]

APP: list[tuple[str, bytes]] = [
    ("invalid JSON", post("/v1/chat/completions", b"{")),
    ("JSON array", chat([])),
    ("JSON null", chat(None)),
    ("JSON string", chat("s")),
    ("empty object", chat({})),
    ("model not a string", chat({"model": 7, "messages": MSG})),
    ("unknown model", chat({"model": "nope", "messages": MSG})),
    ("messages missing", chat({"model": MODEL})),
    ("messages not a list", chat({"model": MODEL, "messages": "hi"})),
    ("message not an object", chat({"model": MODEL, "messages": ["hi"]})),
    ("bad role", chat({"model": MODEL, "messages": [{"role": 5, "content": "hi"}]})),
    ("content a number", chat({"model": MODEL, "messages": [{"role": "user", "content": 5}]})),
    ("max_tokens negative", chat({"model": MODEL, "messages": MSG, "max_tokens": -1})),
    ("max_tokens a string", chat({"model": MODEL, "messages": MSG, "max_tokens": "x"})),
    ("stream not a bool", chat({"model": MODEL, "messages": MSG, "stream": "yes"})),
    ("prompt missing", completion({"model": MODEL})),
    ("prompt a dict", completion({"model": MODEL, "prompt": {"a": 1}})),
    ("prompt negative token ids", completion({"model": MODEL, "prompt": [-1, -2]})),
    ("prompt nested lists", completion({"model": MODEL, "prompt": [[[1]]]})),
    ("prompt too long", completion({"model": MODEL, "prompt": "a " * 60_000})),
    ("body over max_body_bytes", completion({"model": MODEL, "prompt": "a" * (1 << 20)})),
    ("chunked body over max", CHUNKED + b"\r\n" + b"100001\r\n" + b"a" * 0x100001 + b"\r\n0\r\n\r\n"),
    ("invalid UTF-8", post("/v1/chat/completions", b'{"model": "\xff\xfe"}')),
    ("deep nesting", post("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000)),
    ("number 1e999", post("/v1/chat/completions", b'{"model": "x", "max_tokens": 1e999}')),
    ("text/plain body", post("/v1/chat/completions", b"{", ctype=b"text/plain")),
    ("GET on chat", get("/v1/chat/completions")),
    ("unknown path", get("/v1/nope")),
    ("admin without token", get("/admin/replicas")),
    ("admin wrong token", get("/admin/replicas", b"Authorization: Bearer wrong\r\n")),
    ("explain bad body", post("/admin/explain", b"{", extra=b"Authorization: Bearer demo-admin-token\r\n")),
    ("absolute-form URI", b"GET http://evil.example/v1/nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    ("Expect 100-continue oversize", post("/v1/completions", b"", extra=b"Expect: 100-continue\r\n").replace(
        b"Content-Length: 0", b"Content-Length: 99999999")),
    ("empty body", post("/v1/chat/completions", b"")),
]  # fmt: skip

CASES: list[tuple[str, bytes]] = PARSER + APP
