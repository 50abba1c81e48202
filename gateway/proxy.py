"""The OpenAI-compatible proxy: ``POST /v1/completions``, ``POST /v1/chat/completions`` and
``GET /v1/models``.

Per request: read the body (bounded by ``proxy.max_body_bytes``), parse it once with orjson (the
bytes sent upstream are the bytes received, never re-serialised), compute features, match the
index, let the policy choose, add the speculative index entry, then forward.

Retries: a connect error, a connection dropped, or a 503 before the first byte reached the client
is retried on the next-best replica (the policy runs again without the replicas already tried),
at most ``proxy.retries`` times. Nothing is sent to the client until the upstream's first body
byte arrived (a whole body for non-streaming responses), so a retry never duplicates output.

After the first byte, an SSE stream is passed through chunk by chunk; if its replica dies, the
client gets one SSE error event and the stream ends. A client that disconnects cancels its
handler (``handler_cancellation``), which closes the upstream connection: the engine aborts the
request and frees its slot.

Invariants: every ``Flight`` opened here is ended in a ``finally``; every upstream response is
released or closed in a ``finally``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.access_log import AccessLog
from gateway.config import ProxyConfig
from gateway.features.featurizer import Kind
from gateway.fleet import Fleet, ReplicaRecord
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import RequestRejected, error_response, sse_error_event
from gateway.prediction_audit import (
    SseTail,
    cached_tokens_in_body,
    cached_tokens_in_sse_tail,
    record_audit,
)
from gateway.request_errors import RequestError
from gateway.routing import Choice, Router, RoutingState
from gateway.tracing import Tracing
from router_policies.policy import NoReplicaError, RequestFeatures

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length"}
_DROP_RESPONSE = HOP_BY_HOP | {"content-length"}
_UPSTREAM_READ_ERRORS = (aiohttp.ClientError, OSError)


def filter_headers(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str]
) -> CIMultiDict[str]:
    """Copy ``headers`` without hop-by-hop ones (including those the Connection header names)."""
    conn = headers.get("connection")
    named = {t.strip().lower() for t in conn.split(",")} if conn else set()
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk not in drop and lk not in named:
            out.add(k, v)
    return out


class BodyTooLarge(Exception):
    pass


async def read_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        raise BodyTooLarge
    if length is not None:
        return await request.content.readexactly(length) if length else b""
    buf = bytearray()
    while chunk := await request.content.readany():
        buf += chunk
        if len(buf) > limit:
            raise BodyTooLarge
    return bytes(buf)


async def _read_bounded(up: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """The response body if it is at most ``limit`` bytes (True), else its first bytes (False)."""
    length = up.content_length
    if length is not None and length <= limit:
        return await up.read(), True
    buf = bytearray()
    while chunk := await up.content.readany():
        buf += chunk
        if len(buf) > limit:
            return bytes(buf), False
    return bytes(buf), True


class _Retry(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Proxy:
    def __init__(
        self,
        state: Callable[[], RoutingState],
        router: Router,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        tracing: Tracing,
        access_log: AccessLog,
    ) -> None:
        self._state = state
        self._router = router
        self._fleet = fleet
        self._session = session
        self._metrics = metrics
        self._tracing = tracing
        self._access = access_log
        self._timeouts: dict[tuple[float, float], aiohttp.ClientTimeout] = {}

    def _timeout(self, total: float, connect: float) -> aiohttp.ClientTimeout:
        t = self._timeouts.get((total, connect))
        if t is None:
            t = aiohttp.ClientTimeout(total=total, sock_connect=connect)
            self._timeouts = {(total, connect): t}  # one entry: the current config's
        return t

    # ------------------------------------------------------------------ handlers
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat")

    async def models(self, request: web.Request) -> web.StreamResponse:
        """The union of the healthy replicas' ``/v1/models`` lists (first seen wins per id)."""
        cfg = self._state().config
        fwd = filter_headers(request.headers, _DROP_REQUEST)
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
    async def _handle(self, request: web.Request, endpoint: Kind) -> web.StreamResponse:
        t0 = time.perf_counter()
        state = self._state()  # read once: a reload never mixes two configs in one request
        cfg = state.config
        log: dict[str, Any] = {"method": request.method, "path": request.path, "policy": state.policy.name}
        span = None
        if self._tracing.tracer is not None:
            span = self._tracing.tracer.start_span("kvgate.request", attributes={"http.route": request.path})
        body: Any = None
        status = 500
        try:
            response, body = await self._route(request, endpoint, state, t0, log, span)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            log["status"] = status
            log["duration_ms"] = round((time.perf_counter() - t0) * 1000, 3)
            if "replica" not in log:
                self._metrics.requests_by(state.policy.name, "none", str(status)).inc()
            else:
                self._metrics.requests_by(state.policy.name, log["replica"], str(status)).inc()
            if span is not None:
                span.set_attribute("http.status_code", status)
                span.end()
            if cfg.telemetry.access_log:
                self._access.emit(log, body, cfg.telemetry.log_prompts)

    def _error(
        self,
        log: dict[str, Any],
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ) -> web.Response:
        log["error"] = message
        return error_response(status, message, param, code)

    async def _route(
        self,
        request: web.Request,
        endpoint: Kind,
        state: RoutingState,
        t0: float,
        log: dict[str, Any],
        span: Any,
    ) -> tuple[web.StreamResponse, Any]:
        cfg = state.config
        pcfg = cfg.proxy
        try:
            raw = await read_body(request, pcfg.max_body_bytes)
        except BodyTooLarge:
            return self._error(
                log, 413, f"request body exceeds {pcfg.max_body_bytes} bytes", code="body_too_large"
            ), None
        except asyncio.IncompleteReadError:
            return self._error(log, 400, "request body ended early"), None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return self._error(log, 400, f"malformed JSON body: {exc}", code="invalid_json"), None
        if not isinstance(body, dict):
            return self._error(log, 400, "the request body must be a JSON object"), None
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return self._error(log, 400, "'model' is required and must be a string", param="model"), body
        log["model"] = model
        log["stream"] = body.get("stream") is True
        tf = time.perf_counter()
        try:
            features, info = await state.featurizer.features(
                endpoint, body, request.headers.get(pcfg.session_header)
            )
        except (RequestError, RequestRejected) as exc:
            return self._error(log, exc.status, exc.message, param=exc.param, code=exc.code), body
        td = time.perf_counter()
        self._metrics.features_seconds.observe(td - tf)
        self._metrics.features_by(info.mode, "true" if info.approximate else "false").inc()
        if info.approximate:
            log["approximate"] = True
        if info.deferred_chars:
            log["deferred_chars"] = info.deferred_chars
        match = self._router.match(features)
        log["prompt_tokens"] = features.prompt_tokens

        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        out_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0
        fwd_headers = filter_headers(request.headers, _DROP_REQUEST)
        timeout = self._timeout(pcfg.request_timeout_s, pcfg.connect_timeout_s)
        tried: list[str] = []
        last_error = ""
        for attempt in range(pcfg.retries + 1):
            try:
                choice = self._router.choose(state, features, match, frozenset(tried))
            except NoReplicaError:
                if attempt == 0:
                    return self._error(
                        log, 503, f"no healthy replica serves model {model!r}", code="no_healthy_replica"
                    ), body
                return self._error(log, 502, f"upstream failed: {last_error}", code="upstream_error"), body
            if attempt == 0:
                self._metrics.decision_seconds.observe(time.perf_counter() - td)
                self._metrics.predicted_by(state.policy.name).observe(choice.predicted_tokens)
            self._annotate(log, span, features, choice)  # a retry's choice overwrites the first
            rec = choice.record
            if info.deferred is not None:
                # the prompt's full keys become this replica's speculative entries once encoded
                info.deferred.on_keys = functools.partial(self._router.touch, state, rec.id)
            log["replica"] = rec.id
            tried.append(rec.id)
            try:
                resp = await self._attempt(
                    request, rec, choice, features, raw, fwd_headers, timeout, out_tokens,
                    pcfg, attempt < pcfg.retries, info.exact, t0, log,
                )  # fmt: skip
            except _Retry as r:
                last_error = str(r)
                self._metrics.retries_by(r.reason).inc()
                log["retries"] = attempt + 1
                continue
            return resp, body
        return self._error(log, 502, f"upstream failed: {last_error}", code="upstream_error"), body

    def _annotate(self, log: dict[str, Any], span: Any, features: RequestFeatures, choice: Choice) -> None:
        d = choice.decision
        log["reason"] = d.reason
        log["matched_blocks"] = d.matched_blocks
        log["predicted_cached_tokens"] = choice.predicted_tokens
        if span is not None:
            span.set_attribute("kvgate.model", features.model)
            span.set_attribute("kvgate.replica", d.replica)
            span.set_attribute("kvgate.reason", d.reason)
            span.set_attribute("kvgate.prompt_tokens", features.prompt_tokens)
            span.set_attribute("kvgate.block_keys", len(features.block_keys))
            span.set_attribute("kvgate.matched_blocks", d.matched_blocks)
            span.set_attribute("kvgate.predicted_cached_tokens", choice.predicted_tokens)
            for rid, score in d.scores.items():
                span.set_attribute(f"kvgate.score.{rid}", float(score))

    async def _attempt(
        self,
        request: web.Request,
        rec: ReplicaRecord,
        choice: Choice,
        features: RequestFeatures,
        raw: bytes,
        fwd_headers: CIMultiDict[str],
        timeout: aiohttp.ClientTimeout,
        out_tokens: int,
        pcfg: ProxyConfig,
        may_retry: bool,
        audit: bool,
        t0: float,
        log: dict[str, Any],
    ) -> web.StreamResponse:
        predicted = choice.predicted_tokens
        flight = Fleet.begin(
            rec, features.prompt_tokens + out_tokens, max(0, features.prompt_tokens - predicted)
        )
        up: aiohttp.ClientResponse | None = None
        done = False
        try:
            try:
                up = await self._session.post(
                    rec.url + request.path_qs, data=raw, headers=fwd_headers, timeout=timeout
                )
            except aiohttp.ConnectionTimeoutError as exc:
                self._fleet.proxy_failure(rec, f"connect timeout: {exc}", connect=True)
                raise _Retry("connect", f"{rec.id}: connect timeout") from None
            except TimeoutError:
                self._fleet.proxy_failure(rec, "timed out before the response headers")
                return self._error(
                    log, 504, f"replica {rec.id} did not answer in time", code="upstream_timeout"
                )
            except aiohttp.ClientConnectorError as exc:
                self._fleet.proxy_failure(rec, f"connect error: {exc}", connect=True)
                raise _Retry("connect", f"{rec.id}: connect error: {exc}") from None
            except _UPSTREAM_READ_ERRORS as exc:
                self._fleet.proxy_failure(rec, f"{type(exc).__name__}: {exc}")
                raise _Retry("disconnect", f"{rec.id}: {type(exc).__name__}: {exc}") from None
            if up.status == 503 and may_retry:
                raise _Retry("503", f"{rec.id}: 503 Service Unavailable")
            headers = filter_headers(up.headers, _DROP_RESPONSE)
            if pcfg.debug_headers:
                headers["x-kvgate-replica"] = rec.id
                headers["x-kvgate-matched-tokens"] = str(predicted)
            is_sse = up.headers.get("content-type", "").startswith("text/event-stream")
            complete = False
            try:
                if is_sse:
                    first = await up.content.readany()
                else:
                    first, complete = await _read_bounded(up, pcfg.max_buffered_response_bytes)
            except TimeoutError:
                self._fleet.proxy_failure(rec, "timed out before the first byte")
                return self._error(
                    log, 504, f"replica {rec.id} did not answer in time", code="upstream_timeout"
                )
            except _UPSTREAM_READ_ERRORS as exc:
                self._fleet.proxy_failure(rec, f"{type(exc).__name__} before the first byte: {exc}")
                raise _Retry("disconnect", f"{rec.id}: {type(exc).__name__} before the first byte") from None
            flight.first_byte()
            ttft = time.perf_counter() - t0
            self._metrics.ttft_by(rec.id).observe(ttft)
            log["ttft_ms"] = round(ttft * 1000, 3)
            if not is_sse and complete:
                done = True
                if up.status < 500:
                    self._fleet.proxy_success(rec)
                elif up.status != 503:
                    self._fleet.proxy_failure(rec, f"answered {up.status}")
                if audit and up.status == 200:
                    reported = cached_tokens_in_body(first) if up.content_type == "application/json" else None
                    if reported is not None:
                        record_audit(self._metrics, rec, predicted, reported)
                        log["reported_cached_tokens"] = reported
                self._metrics.e2e_by(rec.id).observe(time.perf_counter() - t0)
                return web.Response(status=up.status, body=first, headers=headers)
            # an SSE stream, or a body too large to hold: passed through as it arrives
            resp, done = await self._stream(
                request, rec, up, first, headers, predicted if audit else None, t0, log, is_sse
            )
            return resp
        finally:
            flight.end()
            if up is not None:
                if done:
                    up.release()  # read to the end: the connection goes back to the pool
                else:
                    up.close()  # unread bytes, or a cancelled request: the replica sees it close

    async def _stream(
        self,
        request: web.Request,
        rec: ReplicaRecord,
        up: aiohttp.ClientResponse,
        first: bytes,
        headers: CIMultiDict[str],
        predicted: int | None,
        t0: float,
        log: dict[str, Any],
        sse: bool,
    ) -> tuple[web.StreamResponse, bool]:
        """Pass the response through as it arrives; True when the upstream was read to its end.

        A failure mid-stream ends an SSE stream with an error event; any other body is cut (the
        connection is closed, so the client sees a truncated response, not a complete one).
        ``predicted`` is None when the request is not audited (approximate character keys predict
        no engine tokens)."""
        resp = web.StreamResponse(status=up.status, headers=headers)
        await resp.prepare(request)
        tail = SseTail(first)
        chunk = first
        sent = 0
        complete = False
        try:
            while chunk:
                await resp.write(chunk)
                sent += len(chunk)
                try:
                    chunk = await up.content.readany()
                except (TimeoutError, *_UPSTREAM_READ_ERRORS) as exc:
                    timed_out = isinstance(exc, TimeoutError)
                    what = "timed out" if timed_out else f"failed ({type(exc).__name__})"
                    log["error"] = f"upstream {what} mid-stream"
                    self._fleet.proxy_failure(rec, f"{what} mid-stream: {exc}")
                    if not sse:
                        # the client must not take a cut body for a whole one
                        if request.transport is not None:
                            request.transport.close()
                        break
                    status, code = (504, "upstream_timeout") if timed_out else (502, "upstream_error")
                    await resp.write(sse_error_event(status, f"replica {rec.id} {what} mid-stream", code))
                    await resp.write_eof()
                    break
                if chunk and sse:
                    tail.feed(chunk)
            else:
                complete = True
                self._fleet.proxy_success(rec)
                if sse and predicted is not None and up.status == 200:
                    reported = cached_tokens_in_sse_tail(tail.value())
                    if reported is not None:
                        record_audit(self._metrics, rec, predicted, reported)
                        log["reported_cached_tokens"] = reported
                await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            log["error"] = "client disconnected"
        log["bytes_out"] = sent
        self._metrics.e2e_by(rec.id).observe(time.perf_counter() - t0)
        return resp, complete
