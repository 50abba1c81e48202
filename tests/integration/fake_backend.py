"""A small OpenAI-compatible backend for the gateway's integration tests, run as its own process:

    python tests/integration/fake_backend.py --id r0 --model m [--port 0]

It prints ``fake-backend port=N`` once listening. Its answers are deterministic functions of the
request body, so a test can compare the bytes received through the gateway with the bytes the
backend sends directly. The prompt (or the last chat message) steers its behaviour:

* ``die-before-first-byte@ID``: replica ID exits at once (a replica killed during prefill);
* ``die-mid-stream@ID``: a stream from replica ID sends two chunks, then the process exits;
* ``overloaded@ID``: replica ID answers 503;
* ``hang-forever``: the response never comes (the handler waits until the client goes away);
* ``slow``: stream chunks 0.3 s apart instead of 0.02 s;
* ``late-first-byte``: the answer starts after 1.5 s (a prefill that takes that long).

Responses to generate requests carry ``x-fake-seen-headers`` (the request header names received)
and a ``Proxy-Authenticate`` header (hop-by-hop: a proxy must drop it).
``fake_cached_tokens`` in the body sets ``usage.prompt_tokens_details.cached_tokens``, and
``fake_prompt_tokens`` its ``usage.prompt_tokens`` (default: the prompt's length in characters).
``GET /stats`` returns ``{"active", "requests", "cancelled", "connections"}`` (handlers still
running, requests seen, handlers cancelled by a client disconnect, distinct client connections
that sent requests).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
from typing import Any

from aiohttp import web


class Backend:
    def __init__(self, replica: str, model: str) -> None:
        self.replica = replica
        self.model = model
        self.active = 0
        self.requests = 0
        self.cancelled = 0
        self.peers: set[str] = set()  # client addresses of generate requests (connection reuse)

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="")

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "active": self.active,
                "requests": self.requests,
                "cancelled": self.cancelled,
                "connections": len(self.peers),
            }
        )

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": self.replica}]}
        )

    @staticmethod
    def _echo(request: web.Request) -> dict[str, str]:
        """The names of the request headers received, and a hop-by-hop header the proxy must not
        pass on to its client."""
        return {
            "x-fake-seen-headers": ",".join(sorted(k.lower() for k in request.headers)),
            "proxy-authenticate": "Basic realm=fake",
        }

    @staticmethod
    def _text(body: dict[str, Any]) -> str:
        if "messages" in body:
            return str(body["messages"][-1].get("content", ""))
        return str(body.get("prompt", ""))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.peers.add(str(request.transport.get_extra_info("peername") if request.transport else None))
        body = json.loads(raw)
        text = self._text(body)
        self.requests += 1
        self.active += 1
        try:
            return await self._generate(request, raw, body, text)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _generate(
        self, request: web.Request, raw: bytes, body: dict[str, Any], text: str
    ) -> web.StreamResponse:
        me = f"@{self.replica}"
        if "die-before-first-byte" + me in text:
            os._exit(3)
        if "overloaded" + me in text:
            return web.json_response(
                {"error": {"message": "overloaded", "type": "x", "param": None, "code": 503}}, status=503
            )
        if "hang-forever" in text:
            await asyncio.Event().wait()
        if "late-first-byte" in text:
            await asyncio.sleep(1.5)
        digest = hashlib.sha256(raw).hexdigest()[:16]
        cached = int(body.get("fake_cached_tokens", 0))
        prompt_tokens = int(body.get("fake_prompt_tokens", len(text)))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 3,
            "total_tokens": prompt_tokens + 3,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        words = ["alpha", " béta", " \u03b3\u2603"]  # non-ASCII on purpose
        if not body.get("stream"):
            # odd spacing and key order on purpose: re-serialising would change these bytes
            doc = {
                "id": f"cmpl-{digest}",
                "object": "text_completion",
                "model": body.get("model"),
                "served_by": self.replica,
                "choices": [{"index": 0, "text": "".join(words)}],
                "usage": usage,
            }
            return web.Response(
                body=json.dumps(doc, indent=1, ensure_ascii=False).encode(),
                content_type="application/json",
                headers=self._echo(request),
            )
        resp = web.StreamResponse(
            headers={
                "content-type": "text/event-stream",
                "x-fake-replica": self.replica,
                **self._echo(request),
            }
        )
        await resp.prepare(request)
        for i, w in enumerate(words):
            chunk = {"id": f"cmpl-{digest}", "choices": [{"index": 0, "text": w}], "usage": None}
            await resp.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
            await asyncio.sleep(0.3 if "slow" in text else 0.02)
            if i == 1 and "die-mid-stream" + me in text:
                os._exit(4)
        if (body.get("stream_options") or {}).get("include_usage"):
            final = {"id": f"cmpl-{digest}", "choices": [], "usage": usage}
            await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def main(args: argparse.Namespace) -> None:
    b = Backend(args.id, args.model)
    app = web.Application()
    app.add_routes(
        [
            web.get("/health", b.health),
            web.get("/stats", b.stats),
            web.get("/v1/models", b.models),
            web.post("/v1/completions", b.generate),
            web.post("/v1/chat/completions", b.generate),
        ]
    )
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    print(f"fake-backend port={runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--id", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=0)
    try:
        asyncio.run(main(p.parse_args()))
    except KeyboardInterrupt:
        sys.exit(0)
