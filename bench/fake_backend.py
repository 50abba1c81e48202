"""Fast fake OpenAI backends for the overhead benchmark: several HTTP/1.1 listeners in one
uvloop process, a raw asyncio protocol (no framework), keep-alive, fixed answers.

Answers
* ``POST /v1/chat/completions``, ``/v1/completions``, ``/generate``: a fixed JSON completion, or,
  when the body asks for ``"stream": true``, ``--chunks`` SSE events (``--chunks 0``: the
  request's ``max_tokens`` or ``max_completion_tokens``, one token per event), a usage event when
  it asks for ``"include_usage": true``, and ``data: [DONE]`` in chunked transfer encoding, one
  HTTP chunk per event. With ``--gap-ms 0`` the whole stream is written at once (the backend must never be the
  bottleneck); with ``--gap-ms G`` each listener is one engine decoding in steps of G ms: the first
  event leaves with the headers (no prefill time), then every step writes the next event of every
  stream in its batch (so the streams of one listener tick together, as a batch does in vLLM or
  SGLang, and the backend pays one timer per step, not one per stream);
* ``GET /health``, ``/health_generate``, ``/v1/models``, ``/get_model_info``,
  ``/get_server_info``, ``/metrics`` (vLLM gauges at zero): what routers probe at start-up;
* anything else: 404 with an OpenAI error body.

    python -m bench.fake_backend --ports 0 0 0 --model bench-model

prints ``fake_backend: ports=P1,P2,P3`` once listening (port 0 binds a free port).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import re
import signal
import sys
from dataclasses import dataclass

import uvloop

_MAX_HEADER = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024
MAX_STREAM_CHUNKS = 8192  # --chunks 0 takes max_tokens, capped here
# routers may rename it: sglang-router sends max_completion_tokens, /generate has max_new_tokens
_MAX_TOKENS = re.compile(rb'"max_(?:completion_|new_)?tokens"\s*:\s*(\d+)')
_INCLUDE_USAGE = re.compile(rb'"include_usage"\s*:\s*true')
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _response(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


class Answers:
    """Every response as prepared bytes."""

    def __init__(self, model: str, chunks: int, gap_s: float = 0.0) -> None:
        self.chunks = chunks  # 0: max_tokens of the request
        self.gap_s = gap_s
        completion = {
            "id": "cmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok " * 8},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": 8, "total_tokens": 8},
        }
        self.complete = _response("200 OK", json.dumps(completion).encode())
        # frames[i]: the i-th token's event as one HTTP chunk (about 150 bytes, as vLLM's)
        self.frames = [
            _chunk(b"data: " + json.dumps(_delta(model, i)).encode() + b"\n\n")
            for i in range(chunks or MAX_STREAM_CHUNKS)
        ]
        self.done = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.model = model
        self.stream = _STREAM_HEAD + b"".join(self.frames) + self.done if chunks else b""  # fixed, unpaced
        models = {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "bench"}]}
        info = {"model_path": model, "tokenizer_path": model, "is_generation": True}
        metrics = (
            f'vllm:num_requests_running{{model_name="{model}"}} 0\n'
            f'vllm:num_requests_waiting{{model_name="{model}"}} 0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{model}"}} 0\n'
        ).encode()
        self.get = {
            b"/health": _response("200 OK", b""),
            b"/health_generate": _response("200 OK", b""),
            b"/v1/models": _response("200 OK", json.dumps(models).encode()),
            b"/get_model_info": _response("200 OK", json.dumps(info).encode()),
            b"/get_server_info": _response("200 OK", json.dumps({"model_path": model}).encode()),
            b"/metrics": _response("200 OK", metrics, b"text/plain; version=0.0.4"),
        }
        err = {"error": {"message": "not found", "type": "not_found_error", "param": None, "code": 404}}
        self.not_found = _response("404 Not Found", json.dumps(err).encode())

    def usage(self, tokens: int) -> bytes:
        """The last event of a stream asked with ``include_usage``."""
        doc = {
            "id": "cmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": self.model,
            "choices": [],
            "usage": {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens},
        }
        return _chunk(b"data: " + json.dumps(doc).encode() + b"\n\n")

    def stream_for(self, body: bytes) -> tuple[int, bytes]:
        """(events, the stream's end: usage event if asked, [DONE], last chunk) of a request."""
        n = self.chunks
        if not n:
            m = _MAX_TOKENS.search(body)
            n = min(max(int(m.group(1)), 1), MAX_STREAM_CHUNKS) if m else 1
        end = self.usage(n) + self.done if _INCLUDE_USAGE.search(body) else self.done
        return n, end


def _delta(model: str, i: int) -> dict[str, object]:
    return {
        "id": "cmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
    }


@dataclass(slots=True)
class _Paced:
    """One paced stream in an engine's batch."""

    transport: asyncio.WriteTransport
    next: int  # index of the next event to write
    events: int
    end: bytes  # written with the last event


class Engine:
    """One listener's decode loop for paced streams: every ``gap_s`` (while any stream is
    active) writes the next event of each active stream; a stream whose client went away is
    dropped. One timer per step for the whole batch."""

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.batch: list[_Paced] = []
        self.next_step = 0.0
        self.running = False

    def add(self, transport: asyncio.WriteTransport, body: bytes) -> None:
        a = self.answers
        n, end = a.stream_for(body)
        if n == 1:
            transport.write(_STREAM_HEAD + a.frames[0] + end)
            return
        transport.write(_STREAM_HEAD + a.frames[0])
        self.batch.append(_Paced(transport, 1, n, end))
        if not self.running:
            self.running = True
            loop = asyncio.get_running_loop()
            self.next_step = loop.time() + a.gap_s
            loop.call_at(self.next_step, self.step)

    def step(self) -> None:
        frames = self.answers.frames
        keep = []
        for s in self.batch:
            if s.transport.is_closing():
                continue
            if s.next + 1 >= s.events:
                s.transport.write(frames[s.next] + s.end)
                continue
            s.transport.write(frames[s.next])
            s.next += 1
            keep.append(s)
        self.batch = keep
        if not keep:
            self.running = False
            return
        loop = asyncio.get_running_loop()
        # fixed-rate steps; a late step is not made up for by a burst
        self.next_step = max(self.next_step + self.answers.gap_s, loop.time())
        loop.call_at(self.next_step, self.step)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class BackendProtocol(asyncio.Protocol):
    """One connection: parses pipelined HTTP/1.1 requests from a buffer (bounded) and answers."""

    def __init__(self, answers: Answers, engine: Engine) -> None:
        self.answers = answers
        self.engine = engine
        self.buf = bytearray()
        self.transport: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport implements the WriteTransport interface without subclassing it
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self._one():
            pass

    def _one(self) -> bool:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEADER:
                self._close()
            return False
        head = bytes(buf[:end]).decode("latin-1")
        lines = head.split("\r\n")
        method, path, _ = ([*lines[0].split(" "), "", ""])[:3]
        length = 0
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            lname = name.strip().lower()
            if lname == "content-length":
                length = int(value.strip())
            elif lname == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
        start = end + 4
        if chunked:
            parsed = _dechunk(buf, start)
            if parsed is None:
                return False
            body, consumed = parsed
        else:
            if length > _MAX_BODY:
                self._close()
                return False
            if len(buf) < start + length:
                return False
            body, consumed = bytes(buf[start : start + length]), start + length
        del buf[:consumed]
        self._answer(method, path.split("?")[0].encode(), body)
        return True

    def _answer(self, method: str, path: bytes, body: bytes) -> None:
        assert self.transport is not None
        a = self.answers
        if method == "POST":
            stream = b'"stream":true' in body.replace(b" ", b"")
            if not stream:
                self.transport.write(a.complete)
            elif a.gap_s > 0:
                self.engine.add(self.transport, body)
            elif a.chunks:
                self.transport.write(a.stream)
            else:
                self._unpaced(body)
        else:
            self.transport.write(a.get.get(path, a.not_found))

    def _unpaced(self, body: bytes) -> None:
        assert self.transport is not None
        a = self.answers
        n, end = a.stream_for(body)
        self.transport.write(_STREAM_HEAD + b"".join(a.frames[:n]) + end)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _dechunk(buf: bytearray, pos: int) -> tuple[bytes, int] | None:
    out = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
        pos = eol + 2
        if size == 0:
            if len(buf) < pos + 2:
                return None
            return bytes(out), pos + 2
        if len(buf) < pos + size + 2:
            return None
        out += buf[pos : pos + size]
        pos += size + 2


async def serve(ports: list[int], host: str, answers: Answers) -> None:
    loop = asyncio.get_running_loop()
    servers = []
    for port in ports:
        engine = Engine(answers)  # one per listener: each is its own engine
        servers.append(
            await loop.create_server(
                functools.partial(BackendProtocol, answers, engine), host, port, backlog=1024
            )
        )
    bound = [s.sockets[0].getsockname()[1] for s in servers]
    print("fake_backend: ports=" + ",".join(str(p) for p in bound), flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    for s in servers:
        s.close()
        await s.wait_closed()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ports", type=int, nargs="+", default=[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--model", default="bench-model")
    ap.add_argument(
        "--chunks", type=int, default=16, help="SSE events per streamed answer (0: the request's max_tokens)"
    )
    ap.add_argument("--gap-ms", type=float, default=0.0, help="decode step: ms between a stream's events")
    args = ap.parse_args(argv)
    uvloop.run(serve(args.ports, args.host, Answers(args.model, args.chunks, args.gap_ms / 1000)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
