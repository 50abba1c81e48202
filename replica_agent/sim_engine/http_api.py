"""The aiohttp routes of the simulated engine: vLLM's HTTP API plus /debug endpoints for tests.

Handlers never touch the replica model directly: they submit to the engine core and watch their
``RequestHandle``; reads that must be consistent with the published events (``/debug/blocks``)
run inside the core task at a step boundary. A client that disconnects cancels its handler
(``handler_cancellation``), and the ``finally`` clause aborts the request, freeing its slot and
blocks.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiohttp import web

from replica_agent.sim_engine import protocol as proto
from replica_agent.sim_engine.core import EngineCore, RequestHandle
from replica_agent.sim_engine.kv_events import MAX_FAULT_COUNT, KvEventPublisher
from replica_agent.sim_engine.metrics import CONTENT_TYPE, EngineMetrics
from replica_agent.sim_engine.request_faults import FaultFieldError, RequestFaults
from replica_agent.sim_engine.request_log import RequestLog, Stamps, prompt_key
from replica_agent.sim_engine.tokenization import EngineTokenizer
from router_policies.sim.replica_model import ReplicaModel

# What /version reports (vLLM answers its package version there); names this engine for agents.
ENGINE_VERSION = "kvgate-sim-engine/1"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(err: proto.ApiError) -> web.Response:
    return json_response(err.body(), err.status)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as vLLM's error JSON, including aiohttp's own (404, 405, 413)."""
    try:
        return await handler(request)
    except proto.ApiError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(proto.ApiError(exc.status, exc.reason))


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise proto.ApiError(400, f"request body is not valid JSON: {exc}") from None


_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Deps:
    tokenizer: EngineTokenizer
    # where requests are tokenized: one thread beside the event loop, as vLLM's OpenAI server
    # does (``OpenAIServing``'s ``_tokenizer_executor``, a ``ThreadPoolExecutor(max_workers=1)``
    # behind ``make_async``), and its engine core steps in a process of its own: a long prompt's
    # tokenization never holds up the steps of the requests already running (on the loop, a
    # 6,000-token prompt held this engine's steps ~15 ms; docs/sim-engine.md)
    tokenize_pool: Executor
    limits: proto.ServingLimits
    core: EngineCore
    model: ReplicaModel
    publisher: KvEventPublisher
    metrics: EngineMetrics
    seed: int
    model_root: str
    started: int
    request_log: RequestLog | None = None  # --request-log: each request's arrival, parse, first token


# a generation request's ``Stamps`` (with a request log) in the request's own state
STAMPS = web.RequestKey("kvgate_request_stamps", Stamps)


class Routes:
    def __init__(self, deps: Deps) -> None:
        self.d = deps
        # Response ids are random hex like vLLM's, from a seeded generator.
        self._rng = random.Random(deps.seed)
        self.request_faults = RequestFaults()  # /debug/faults, per generation request

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/debug/blocks", self.debug_blocks)
        app.router.add_get("/debug/faults", self.get_faults)
        app.router.add_post("/debug/faults", self.set_faults)
        app.router.add_get("/debug/state", self.debug_state)

    # ------------------------------------------------------------------ vLLM API
    async def _parsed(
        self, request: web.Request, parse: Callable[[Any, EngineTokenizer, proto.ServingLimits], _T]
    ) -> tuple[Any, _T]:
        """The request's JSON body and ``parse`` of it (validation and tokenization) on
        ``tokenize_pool``."""
        body = await read_json(request)
        d = self.d
        parsed = await asyncio.get_running_loop().run_in_executor(
            d.tokenize_pool, parse, body, d.tokenizer, d.limits
        )
        return body, parsed

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, proto.parse_completion, "cmpl-")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, proto.parse_chat, "chatcmpl-")

    async def _generation(
        self,
        request: web.Request,
        parse: Callable[[Any, EngineTokenizer, proto.ServingLimits], proto.GenerationRequest],
        prefix: str,
    ) -> web.StreamResponse:
        """A generation request, parsed then generated. With a request log, its arrival here, the
        parse's end and (``_stream``) its first token are noted in the request's ``STAMPS``, and
        logged however the handler ends (an error, a fault, the client gone); a request whose
        parse failed has no line."""
        arrived = time.monotonic()
        body, req = await self._parsed(request, parse)
        log = self.d.request_log
        if log is not None:
            request[STAMPS] = Stamps(prompt_key(body), arrived, time.monotonic())
        try:
            return await self._generate(request, req, prefix)
        finally:
            if log is not None:
                log.record(request[STAMPS])

    async def models(self, _request: web.Request) -> web.StreamResponse:
        d = self.d
        return json_response(
            proto.model_list(d.limits.model, d.model_root, d.limits.max_model_len, d.started)
        )

    async def health(self, _request: web.Request) -> web.StreamResponse:
        if not self.d.core.alive:
            raise proto.ApiError(503, "engine core is not running")
        return web.Response(status=200)

    async def version(self, _request: web.Request) -> web.StreamResponse:
        return json_response({"version": ENGINE_VERSION})

    async def metrics(self, _request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.d.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        # not a generation request: no line in the request log (vllm-router's kv_aware calls it
        # on every engine with the same prompt before its completion, which the bench's
        # matching by prompt would take for the completion's arrival)
        _body, parsed = await self._parsed(request, proto.parse_tokenize)
        return json_response(parsed)

    async def reset_prefix_cache(self, _request: web.Request) -> web.StreamResponse:
        if not await self.d.core.call(self.d.model.clear):
            raise proto.ApiError(503, "cannot reset the prefix cache while requests hold KV blocks")
        return web.Response(status=200)

    # ------------------------------------------------------------------ debug
    async def debug_blocks(self, _request: web.Request) -> web.StreamResponse:
        keys = await self.d.core.call(lambda: sorted(self.d.model.cached_ids()))
        return json_response({"block_size": self.d.model.config.block_size, "keys": keys})

    def _fault_state(self) -> dict[str, Any]:
        p = self.d.publisher
        return {**p.faults.as_dict(), "next_seq": p.next_seq, "requests": self.request_faults.as_dict()}

    async def get_faults(self, _request: web.Request) -> web.StreamResponse:
        return json_response(await self.d.core.call(self._fault_state))

    async def set_faults(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise proto.ApiError(400, "request body must be a JSON object")
        event_fields = {"drop", "duplicate", "reorder", "from_replay"}
        if RequestFaults.mentioned(body):
            try:
                self.request_faults.set(body)
            except FaultFieldError as exc:
                raise proto.ApiError(400, str(exc), exc.field) from None
            if not event_fields & set(body):  # request faults only: the event faults stay
                body = {k: v for k, v in body.items() if k not in RequestFaults.fields()}
                if not body:
                    return json_response(await self.d.core.call(self._fault_state))
        unknown = set(body) - event_fields - RequestFaults.fields()
        if unknown:
            raise proto.ApiError(
                400, f"unknown fault field(s): {', '.join(sorted(unknown))}", sorted(unknown)[0]
            )
        counts: dict[str, int] = {}
        for name in ("drop", "duplicate", "reorder"):
            value = body.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_FAULT_COUNT:
                raise proto.ApiError(400, f"'{name}' must be an integer in [0, {MAX_FAULT_COUNT}]", name)
            counts[name] = value
        from_replay = body.get("from_replay", False)
        if not isinstance(from_replay, bool):
            raise proto.ApiError(400, "'from_replay' must be a boolean", "from_replay")

        def apply() -> dict[str, Any]:
            self.d.publisher.set_faults(counts["drop"], from_replay, counts["duplicate"], counts["reorder"])
            return self._fault_state()

        return json_response(await self.d.core.call(apply))

    async def debug_state(self, _request: web.Request) -> web.StreamResponse:
        d = self.d

        def read() -> dict[str, Any]:
            m = d.model.metrics()
            p = d.publisher
            return {
                "pending": d.core.pending,
                "running": m.running,
                "waiting": m.waiting,
                "held_blocks": len(d.model.cached_ids()),
                "registry_entries": d.core.registry_entries,
                "next_seq": p.next_seq,
                "replay_buffered": p.buffered,
                "published": {
                    "batches": p.stats.batches,
                    "sent": p.stats.sent,
                    "dropped": p.stats.dropped,
                    "replay_requests": p.stats.replay_requests,
                },
            }

        return json_response(await d.core.call(read))

    # ------------------------------------------------------------------ generation
    async def _fault(self, req: proto.GenerationRequest) -> str | None:
        """Apply the next request fault that acts before generation; the one left to act later
        (``corrupt``, ``stall``), or None."""
        kind = self.request_faults.take()
        if kind == "error":
            raise proto.ApiError(self.request_faults.error_status, "injected fault (/debug/faults error)")
        if kind == "hang" or (kind == "stall" and not req.stream):
            await asyncio.Event().wait()  # until the client goes away (handler cancellation)
        if kind == "slow":
            await asyncio.sleep(self.request_faults.slow_ms / 1000)
        return kind

    async def _generate(
        self, request: web.Request, req: proto.GenerationRequest, prefix: str
    ) -> web.StreamResponse:
        d = self.d
        fault = await self._fault(req)
        if fault == "corrupt":
            if req.stream:
                body = b'data: {"id": "corrupt", "choices": [{"delta": \x00\xff\n\n'
                return web.Response(body=body, content_type="text/event-stream")
            return web.Response(
                body=b'{"id": "corrupt", "choices": [\x00\xff', content_type="application/json"
            )
        handle = d.core.submit(req.prompt_tokens, req.max_tokens)
        rid = prefix + f"{self._rng.getrandbits(128):032x}"
        created = proto.now_s()
        out = d.tokenizer.pseudo_tokens(d.seed, req.prompt_tokens, req.max_tokens)
        try:
            if req.stream:
                return await self._stream(request, req, handle, (rid, created), out, fault == "stall")
            while not handle.finished:
                await handle.changed.wait()
                handle.changed.clear()
                if handle.error is not None:
                    raise proto.ApiError(503, f"request failed: {handle.error}")
            use = proto.usage(handle.prompt_len, handle.produced, handle.cached_tokens)
            text = d.tokenizer.decode(out[: handle.produced])
            return json_response(proto.full_response(req, rid, created, text, "length", use))
        finally:
            stamps = request.get(STAMPS)
            if stamps is not None and handle.first_token_at is not None:
                stamps.cached = handle.cached_tokens  # set with its first token (core.py)
            if not handle.finished:
                d.core.abort(handle)

    async def _stream(
        self,
        request: web.Request,
        req: proto.GenerationRequest,
        handle: RequestHandle,
        ident: tuple[str, int],
        out: list[int],
        stall: bool,
    ) -> web.StreamResponse:
        """``ident``: the response id and creation time; ``stall``: stop after the first event."""
        tok = self.d.tokenizer
        rid, created = ident
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")

        stamps = request.get(STAMPS)

        sent = 0
        try:
            while True:
                await handle.changed.wait()
                handle.changed.clear()
                if handle.error is not None:
                    await send(proto.ApiError(503, f"request failed: {handle.error}").body())
                    break
                if sent == 0 and req.chat and handle.produced > 0:
                    await send(proto.chunk(req, rid, created, "", None, True, None))
                if stall:
                    await send(proto.chunk(req, rid, created, "", None, True, None))
                    await asyncio.Event().wait()  # a stream that stops: until the client goes away
                last = handle.produced
                for i in range(sent, last):
                    final = handle.finished and i == last - 1
                    use = (
                        proto.usage(handle.prompt_len, i + 1, handle.cached_tokens)
                        if req.continuous_usage
                        else None
                    )
                    await send(
                        proto.chunk(
                            req, rid, created, tok.decode([out[i]]), "length" if final else None, False, use
                        )
                    )
                    if stamps is not None:
                        stamps.first_token(time.monotonic())
                sent = last
                if handle.finished:
                    if req.include_usage:
                        use = proto.usage(handle.prompt_len, handle.produced, handle.cached_tokens)
                        await send(proto.usage_chunk(req, rid, created, use))
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away; the caller's finally aborts the request
        return resp
