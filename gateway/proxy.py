"""The OpenAI-compatible proxy: ``POST /v1/completions``, ``POST /v1/chat/completions`` and
``GET /v1/models`` (docs/architecture.md, "Request path").

Per request, top to bottom (``Proxy._handle`` -> ``_route``): read the body (bounded by
``proxy.max_body_bytes``) and parse it once into a ``ParsedRequest`` (the bytes sent upstream are
the bytes received, never re-serialised); compute features; match the index; then per attempt:
``Router.decide`` (pure), ``Router.commit`` (the policy's commit and the speculative entries),
``Upstream.send``.

Retries: a connect error, a connection dropped, or a 503 before the first byte reached the client
is retried on the next-best replica (the policy decides again without the replicas already
tried, and the failed attempt's speculative entries are undone), at most ``proxy.retries`` times.

A client that disconnects cancels its handler (``handler_cancellation``), which closes the
upstream connection: the engine aborts the request and frees its slot. Every error is a
``RequestError`` answered by ``RequestContext.error``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from gateway.access_log import AccessLog
from gateway.config import ProxyConfig
from gateway.features.budgets import ByteBudget
from gateway.features.feature_info import FeatureInfo
from gateway.fleet import Fleet, ReplicaRecord
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import RequestError
from gateway.request import Endpoint, parse_request
from gateway.request_context import DROP_REQUEST, Attempt, RequestContext, filter_headers
from gateway.request_outcome import OutcomeSink
from gateway.routing import Choice, Router, RoutingState
from gateway.tracing import Tracing
from gateway.upstream import Retry, Upstream
from gateway.upstream_client import UpstreamClient
from router_policies.flights import Dispatch
from router_policies.policy import NoReplicaError, RequestFeatures

__all__ = ["BodyTooLarge", "Proxy", "ProxyParts", "read_body"]

# an x-request-id longer than this is logged cut (the line stays bounded, whatever a client sends)
MAX_REQUEST_ID_CHARS = 128


class BodyTooLarge(RequestError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes", status=413, code="body_too_large")


async def read_body(request: web.Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, at most ``limit`` bytes, received whole within ``timeout_s`` (raises
    ``BodyTooLarge``, ``RequestError`` for a body that ended early, or 408 for a slow one)."""
    try:
        if request.content.is_eof():  # the whole body is here already: no timer to arm
            return await _read_body(request, limit)
        async with asyncio.timeout(timeout_s):
            return await _read_body(request, limit)
    except TimeoutError:
        raise RequestError(
            f"request body not received in {timeout_s}s", status=408, code="body_timeout"
        ) from None


async def _read_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        raise BodyTooLarge(limit)
    try:
        if length is not None:
            return await request.content.readexactly(length) if length else b""
    except asyncio.IncompleteReadError:
        raise RequestError("request body ended early") from None
    buf = bytearray()
    while chunk := await request.content.readany():
        buf += chunk
        if len(buf) > limit:
            raise BodyTooLarge(limit)
    return bytes(buf)


@dataclass(frozen=True, slots=True)
class ProxyParts:
    """What the proxy uses, built by the composition root (``gateway.app``)."""

    router: Router
    fleet: Fleet
    session: aiohttp.ClientSession  # for ``/v1/models`` (fans out to every replica)
    client: UpstreamClient  # for the request path (gateway/upstream_client.py)
    metrics: GatewayMetrics
    tracing: Tracing
    access_log: AccessLog
    outcomes: OutcomeSink | None = None


class Proxy:
    def __init__(self, state: Callable[[], RoutingState], parts: ProxyParts) -> None:
        self._state = state
        self._router = parts.router
        self._fleet = parts.fleet
        self._session = parts.session
        self._upstream = Upstream(parts.client, parts.fleet, parts.metrics)
        self._upstream.outcomes = parts.outcomes
        self._metrics = parts.metrics
        self._tracing = parts.tracing
        self._access = parts.access_log
        # request bodies held at once (server.* settings apply at start: a restart changes them)
        self._bodies = ByteBudget(state().config.server.max_inflight_body_bytes)

    async def stop(self) -> None:
        """End the request path's own tasks (``Upstream.stop``); the listener is closed first."""
        await self._upstream.stop()

    def memory_stats(self) -> dict[str, tuple[int, int]]:
        """Request bodies held: (bytes, bound), as ``Featurizer.memory_stats``."""
        return {"request_bodies": (self._bodies.held, self._bodies.limit)}

    async def _body_room(self, request: web.Request, pcfg: ProxyConfig) -> int:
        """Hold the request body's bytes against ``server.max_inflight_body_bytes`` (raises 503
        when there is no room within ``proxy.body_timeout_s``); returns what the caller releases
        (``self._bodies.release``) when the request ends. A plain call, not a context manager:
        this runs for every request."""
        length = request.content_length
        need = pcfg.max_body_bytes if length is None else min(length, pcfg.max_body_bytes)
        if self._bodies.try_acquire(need):  # no timer when there is room (most requests)
            return need
        try:
            async with asyncio.timeout(pcfg.body_timeout_s):
                await self._bodies.acquire(need)
        except TimeoutError:
            raise RequestError(
                "the gateway holds too many request bodies; retry later",
                status=503,
                code="overloaded",
            ) from None
        return need

    # ------------------------------------------------------------------ handlers
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat")

    async def models(self, request: web.Request) -> web.StreamResponse:
        """The union of the healthy replicas' ``/v1/models`` lists (first seen wins per id)."""
        cfg = self._state().config
        fwd = filter_headers(request.headers, DROP_REQUEST)
        timeout = aiohttp.ClientTimeout(total=cfg.health.timeout_s + cfg.proxy.connect_timeout_s)

        async def one(rec: ReplicaRecord) -> list[Any]:
            try:
                async with self._session.get(rec.url + "/v1/models", headers=fwd, timeout=timeout) as r:
                    if r.status != 200:
                        return []
                    doc = orjson.loads(await r.read())
            except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError):
                return []
            data = doc.get("data") if isinstance(doc, dict) else None
            return data if isinstance(data, list) else []

        recs = [r for r in self._fleet.records() if r.healthy]
        lists = await asyncio.gather(*(one(r) for r in recs))
        seen: dict[str, Any] = {}
        for items in lists:
            for item in items:
                if isinstance(item, dict) and isinstance(item.get("id"), str):
                    seen.setdefault(item["id"], item)
        return web.Response(
            body=orjson.dumps({"object": "list", "data": list(seen.values())}),
            content_type="application/json",
        )

    # ------------------------------------------------------------------ the request path
    async def _handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        state = self._state()  # read once: a reload never mixes two configs in one request
        span = None
        if self._tracing.tracer is not None:
            span = self._tracing.tracer.start_span("kvgate.request", attributes={"http.route": request.path})
        ctx = RequestContext(request, state, span)
        ctx.log.update(method=request.method, path=request.path, policy=state.policy.name)
        rid = request.headers.get("x-request-id")
        if rid:  # the client's id, to join its own records to this line (forwarded upstream as is)
            ctx.log["request_id"] = rid[:MAX_REQUEST_ID_CHARS]
        status = 500
        try:
            try:
                held = await self._body_room(request, state.config.proxy)
                try:
                    response = await self._route(ctx, endpoint)
                finally:
                    self._bodies.release(held)
            except RequestError as exc:
                response = ctx.error(exc)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            self._finish(ctx, status)

    def _finish(self, ctx: RequestContext, status: int) -> None:
        """Count, trace and log the request (its handler's ``finally``)."""
        log, policy = ctx.log, ctx.state.policy.name
        log["status"] = status
        log["duration_ms"] = round(ctx.elapsed() * 1000, 3)
        self._metrics.requests_by(policy, log.get("replica", "none"), str(status)).inc()
        if ctx.span is not None:
            ctx.span.set_attribute("http.status_code", status)
            ctx.span.end()
        telemetry = ctx.state.config.telemetry
        if telemetry.access_log:
            body = ctx.parsed.body if ctx.parsed is not None else None
            self._access.emit(log, body, telemetry.log_prompts)

    async def _route(self, ctx: RequestContext, endpoint: Endpoint) -> web.StreamResponse:
        """Parse, featurize, match, then try replicas until one answers (raises ``RequestError``)."""
        pcfg = ctx.state.config.proxy
        raw = await read_body(ctx.request, pcfg.max_body_bytes, pcfg.body_timeout_s)
        req = parse_request(endpoint, raw, ctx.request.headers.get(pcfg.session_header))
        ctx.parsed = req
        ctx.log["model"] = req.model
        ctx.log["stream"] = req.stream
        features, info = await self._features(ctx)
        td = ctx.elapsed()
        match = self._router.match(features)
        tried: list[str] = []
        last_error = ""
        for attempt in range(pcfg.retries + 1):
            if (turn := self._fleet.decision_turn()) is not None:
                await turn  # several workers: one decides at a time (no await until the dispatch)
            try:
                choice = self._router.decide(ctx.state, features, match, frozenset(tried))
            except NoReplicaError:
                if attempt == 0:
                    raise RequestError(
                        f"no healthy replica serves model {req.model!r}",
                        status=503,
                        code="no_healthy_replica",
                    ) from None
                break
            if attempt == 0:
                self._metrics.decision_time.observe(ctx.elapsed() - td)
                self._metrics.predicted_by(ctx.state.policy.name).observe(choice.predicted_tokens)
            ctx.annotate(features, choice)
            tried.append(choice.record.id)
            try:
                return await self._attempt(ctx, features, info, choice, attempt < pcfg.retries)
            except Retry as r:
                last_error = str(r)
                self._metrics.retries_by(r.reason).inc()
                ctx.log["retries"] = attempt + 1
        raise RequestError(f"upstream failed: {last_error}", status=502, code="upstream_error")

    async def _attempt(
        self,
        ctx: RequestContext,
        features: RequestFeatures,
        info: FeatureInfo,
        choice: Choice,
        may_retry: bool,
    ) -> web.StreamResponse:
        """Send the request to ``choice``'s replica and answer the client; a ``Retry`` undoes the
        attempt's speculative entries. The attempt's load is published first (a worker of several:
        the other workers decide on it from now, and this decision's turn ends). The request is
        written next (``Upstream.start``: on an idle pooled connection, with no await), then the
        decision committed: the replica starts on it while the commit and the dispatch's
        accounting run, and, as nothing awaits in between, no other request of this process
        decides before the commit (decide, then commit, still holds)."""
        assert ctx.parsed is not None
        dispatch = Dispatch.of(choice.state, features, choice.predicted_tokens, ctx.parsed.max_output_tokens)
        self._fleet.flights_changed(choice.record, dispatch)  # until its flight opens (Upstream.send)
        sending = self._upstream.start(ctx, choice.record)
        try:
            speculation = self._router.commit(ctx.state, features, choice)
            a = Attempt(ctx, features, info, choice, dispatch, speculation, may_retry)
            if info.deferred is not None and not info.deferred.finished.is_set():
                # the prompt's full keys become this attempt's speculative entries once encoded,
                # its leading ones sooner if a takeover encodes them first (a job that finished
                # while the request was routed holds no callback: DeferredJob)
                record = functools.partial(self._router.record, a.speculation)
                info.deferred.on_keys = info.deferred.on_prefix = record
                if self._upstream.outcomes is not None:
                    self._upstream.outcomes.deferred(a)
        except BaseException:  # no flight will open: the load published for it goes
            self._fleet.flights_changed(choice.record)
            sending.abandon()
            raise
        try:
            return await self._upstream.send(a, sending)
        except Retry:
            self._router.undo(a.speculation)
            raise
        finally:
            sending.abandon()  # nothing once send finished it; else its connection closes

    async def _features(self, ctx: RequestContext) -> tuple[RequestFeatures, FeatureInfo]:
        assert ctx.parsed is not None
        tf = ctx.elapsed()
        features, info = await ctx.state.featurizer.featurize(ctx.parsed)
        self._metrics.features_time.observe(ctx.elapsed() - tf)
        self._metrics.features_by(info.mode, "true" if info.approximate else "false").inc()
        if info.approximate:
            ctx.log["approximate"] = True
        if info.deferred_chars:
            ctx.log["deferred_chars"] = info.deferred_chars
        ctx.log["prompt_tokens"] = features.prompt_tokens
        return features, info
