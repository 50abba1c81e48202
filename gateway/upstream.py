"""Sending one attempt to its replica and passing the answer back (docs/architecture.md, "Request
path", the last steps).

Nothing is sent to the client until the upstream's first body byte arrived (a whole body for
non-streaming responses), so a retry never duplicates output: a connect error, a connection
dropped, or a 503 before that raises ``Retry`` (when the attempt ``may_retry``). After the first
byte, an SSE stream is passed through chunk by chunk; if its replica dies, the client gets one
SSE error event and the stream ends.

Invariants: every ``Flight`` opened here is ended in a ``finally``; every upstream response is
released (read to its end) or closed in a ``finally``.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import RequestError, sse_error_event
from gateway.prediction_audit import SseTail, cached_tokens_in_body, cached_tokens_in_sse_tail, record_audit
from gateway.request_context import DROP_REQUEST, DROP_RESPONSE, Attempt, filter_headers

UPSTREAM_READ_ERRORS = (aiohttp.ClientError, OSError)


class Retry(Exception):
    """The attempt failed before anything reached the client: try another replica."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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


def _timed_out(a: Attempt) -> RequestError:
    return RequestError(f"replica {a.record.id} did not answer in time", status=504, code="upstream_timeout")


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, fleet: Fleet, metrics: GatewayMetrics) -> None:
        self._session = session
        self._fleet = fleet
        self._metrics = metrics

    async def _post(self, a: Attempt) -> aiohttp.ClientResponse:
        """The replica's response headers; a failure to get them raises ``Retry`` or a 504."""
        ctx, rec = a.ctx, a.record
        assert ctx.parsed is not None
        try:
            return await self._session.post(
                rec.url + ctx.request.path_qs,
                data=ctx.parsed.raw,
                headers=filter_headers(ctx.request.headers, DROP_REQUEST),
                timeout=ctx.timeout,
            )
        except aiohttp.ConnectionTimeoutError as exc:
            self._fleet.proxy_failure(rec, f"connect timeout: {exc}", connect=True)
            raise Retry("connect", f"{rec.id}: connect timeout") from None
        except TimeoutError:
            self._fleet.proxy_failure(rec, "timed out before the response headers")
            raise _timed_out(a) from None
        except aiohttp.ClientConnectorError as exc:
            self._fleet.proxy_failure(rec, f"connect error: {exc}", connect=True)
            raise Retry("connect", f"{rec.id}: connect error: {exc}") from None
        except UPSTREAM_READ_ERRORS as exc:
            self._fleet.proxy_failure(rec, f"{type(exc).__name__}: {exc}")
            raise Retry("disconnect", f"{rec.id}: {type(exc).__name__}: {exc}") from None

    async def _first(self, a: Attempt, up: aiohttp.ClientResponse, sse: bool) -> tuple[bytes, bool]:
        """The first body bytes (the whole body when it fits, True) before anything is sent."""
        rec = a.record
        try:
            if sse:
                return await up.content.readany(), False
            return await _read_bounded(up, a.ctx.state.config.proxy.max_buffered_response_bytes)
        except TimeoutError:
            self._fleet.proxy_failure(rec, "timed out before the first byte")
            raise _timed_out(a) from None
        except UPSTREAM_READ_ERRORS as exc:
            self._fleet.proxy_failure(rec, f"{type(exc).__name__} before the first byte: {exc}")
            raise Retry("disconnect", f"{rec.id}: {type(exc).__name__} before the first byte") from None

    def _audit(self, a: Attempt, reported: int | None) -> None:
        if reported is not None:
            record_audit(self._metrics, a.record, a.choice.predicted_tokens, reported)
            a.ctx.log["reported_cached_tokens"] = reported

    async def send(self, a: Attempt) -> web.StreamResponse:
        """Forward the request to the attempt's replica and answer the client (raises ``Retry``,
        or ``RequestError`` for a replica too slow to answer)."""
        ctx, rec, features = a.ctx, a.record, a.features
        assert ctx.parsed is not None
        out_tokens = ctx.parsed.max_output_tokens
        predicted = a.choice.predicted_tokens
        flight = Fleet.begin(
            rec, features.prompt_tokens + out_tokens, max(0, features.prompt_tokens - predicted)
        )
        up: aiohttp.ClientResponse | None = None
        done = False
        try:
            up = await self._post(a)
            if up.status == 503 and a.may_retry:
                raise Retry("503", f"{rec.id}: 503 Service Unavailable")
            if up.status == 404 and a.may_retry and features.lora is not None:  # adapter not loaded there
                raise Retry("404", f"{rec.id}: 404 for LoRA adapter {features.lora!r}")
            headers = filter_headers(up.headers, DROP_RESPONSE)
            if ctx.state.config.proxy.debug_headers:
                headers["x-kvgate-replica"] = rec.id
                headers["x-kvgate-matched-tokens"] = str(predicted)
            is_sse = up.headers.get("content-type", "").startswith("text/event-stream")
            first, complete = await self._first(a, up, is_sse)
            flight.first_byte()
            ttft = ctx.elapsed()
            self._metrics.ttft_by(rec.id).observe(ttft)
            ctx.log["ttft_ms"] = round(ttft * 1000, 3)
            if not is_sse and complete:
                done = True
                if up.status < 500:
                    self._fleet.proxy_success(rec)
                elif up.status != 503:
                    self._fleet.proxy_failure(rec, f"answered {up.status}")
                if a.audited and up.status == 200 and up.content_type == "application/json":
                    self._audit(a, cached_tokens_in_body(first))
                self._metrics.e2e_by(rec.id).observe(ctx.elapsed())
                return web.Response(status=up.status, body=first, headers=headers)
            # an SSE stream, or a body too large to hold: passed through as it arrives
            resp, done = await self._stream(a, up, first, headers, is_sse)
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
        a: Attempt,
        up: aiohttp.ClientResponse,
        first: bytes,
        headers: CIMultiDict[str],
        sse: bool,
    ) -> tuple[web.StreamResponse, bool]:
        """Pass the response through as it arrives; True when the upstream was read to its end.

        A failure mid-stream ends an SSE stream with an error event; any other body is cut (the
        connection is closed, so the client sees a truncated response, not a complete one)."""
        ctx, rec, request = a.ctx, a.record, a.ctx.request
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
                except (TimeoutError, *UPSTREAM_READ_ERRORS) as exc:
                    timed_out = isinstance(exc, TimeoutError)
                    what = "timed out" if timed_out else f"failed ({type(exc).__name__})"
                    ctx.log["error"] = f"upstream {what} mid-stream"
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
                if sse and a.audited and up.status == 200:
                    self._audit(a, cached_tokens_in_sse_tail(tail.value()))
                await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            ctx.log["error"] = "client disconnected"
        ctx.log["bytes_out"] = sent
        self._metrics.e2e_by(rec.id).observe(ctx.elapsed())
        return resp, complete
