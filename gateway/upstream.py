"""Sending one attempt to its replica and passing the answer back (docs/architecture.md, "Request
path", the last steps).

Nothing is sent to the client until the upstream's first body byte arrived (a whole body for
non-streaming responses), so a retry never duplicates output: a connect error, a connection
dropped, a 503, no first byte in time (``proxy.first_byte_timeout_s`` for a streaming request,
``proxy.request_timeout_s`` for a non-streaming one, whose answer arrives whole), or the replica
ejected (by health checks or passive failures) while the attempt waits, raises ``Retry`` before
that (when the attempt ``may_retry``; otherwise 504). After the first byte, an SSE stream is
passed through chunk by chunk; a replica that dies, or sends nothing for
``proxy.stream_idle_timeout_s``, ends it with one SSE error event. Streams have no total timeout:
long healthy ones are never cut.

The first-byte wait and the failover of attempts whose replica is ejected while they wait:
``gateway/upstream_watch.py`` (one task for all waits, no timer per request).

Invariants: every ``Flight`` opened here is ended in a ``finally``; every upstream response is
released (read to its end) or closed in a ``finally``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from gateway.asyncio_tasks import TaskSet
from gateway.fleet import Fleet, ReplicaRecord
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import RequestError, sse_error_event
from gateway.prediction_audit import AttemptAudit, SseTail, held_prefix_hint, inexact_cause, record_audit
from gateway.request_context import DROP_REQUEST, DROP_RESPONSE, Attempt, RequestContext, filter_headers
from gateway.request_outcome import OutcomeSink, Usage, usage_in
from gateway.stream_relay import ChunkRelay, ClientGone, DirectRelay, IdleWatch, RelayResponse
from gateway.upstream_client import ConnectError, ConnectTimeout, Outgoing, UpstreamClient, UpstreamResponse
from gateway.upstream_watch import EjectionWatch, FirstByteWait
from router_policies.flights import Flight

UPSTREAM_READ_ERRORS = (aiohttp.ClientError, OSError)
LATE_AUDIT_S = 30.0  # longest an audit waits for a deferred encode's keys (then audited without)


@dataclass(slots=True)
class Sending:
    """A request ``Upstream.start`` wrote to a pooled connection (or that ``send`` writes on a new
    one), and the TTFT model's clock just before: the attempt's flight starts there, so its
    first-byte time counts neither the commit after the write nor the core the woken replica
    may take from the gateway during it."""

    out: Outgoing
    at: float | None

    def abandon(self) -> None:
        """``Outgoing.abandon``: an attempt that fails before ``send`` closes its connection."""
        self.out.abandon()


class Retry(Exception):
    """The attempt failed before anything reached the client: try another replica."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


async def _read_bounded(up: UpstreamResponse, limit: int) -> tuple[bytes, bool]:
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


def _first_byte_limit(a: Attempt) -> float:
    """How long the attempt may wait for its first byte: a stream's first event, or a
    non-streaming answer (which arrives whole)."""
    assert a.ctx.parsed is not None
    p = a.ctx.state.config.proxy
    return p.first_byte_timeout_s if a.ctx.parsed.stream else p.request_timeout_s


def _timed_out(a: Attempt) -> RequestError:
    return RequestError(f"replica {a.record.id} did not answer in time", status=504, code="upstream_timeout")


class Upstream:
    def __init__(self, client: UpstreamClient, fleet: Fleet, metrics: GatewayMetrics) -> None:
        self._client = client
        self._fleet = fleet
        self._metrics = metrics
        self.outcomes: OutcomeSink | None = None  # the operator view (gateway/operator_view.py)
        self._watch = EjectionWatch()
        # audits waiting for a deferred encode's keys (at most one per such request, each bounded
        # by LATE_AUDIT_S); held here so that they are not collected while they wait
        self._late_audits = TaskSet()

    async def stop(self) -> None:
        """Cancel the audits still waiting for a deferred encode's keys (after the listener has
        closed: no request adds one; before the featurizer closes: they wait on its encodes)."""
        await self._late_audits.stop()

    def start(self, ctx: RequestContext, rec: ReplicaRecord) -> Sending:
        """Begin sending the request to ``rec`` without awaiting (``UpstreamClient.start``): on an
        idle pooled connection the replica has it before the decision is committed, which takes
        no await either, so no other request decides in between (``send`` finishes it)."""
        assert ctx.parsed is not None
        headers = filter_headers(ctx.request.headers, DROP_REQUEST)
        # both clocks read before the write: the replica woken by it may take this core before
        # the write returns, and that time is the replica's, spent on this request
        at = self._fleet.ttft.now()
        ctx.log["dispatch_ms"] = round(ctx.elapsed() * 1000, 3)  # the gateway's own share of ttft_ms
        return Sending(self._client.start(rec.url + ctx.request.path_qs, ctx.parsed.raw, headers), at)

    async def _post(self, a: Attempt, out: Outgoing) -> UpstreamResponse:
        """The replica's response headers; a failure to get them raises ``Retry``."""
        ctx, rec = a.ctx, a.record
        try:
            return await self._client.finish(out, ctx.state.config.proxy.connect_timeout_s)
        except (ConnectTimeout, ConnectError) as exc:
            self._fleet.proxy_failure(rec, str(exc), connect=True)
            raise Retry("connect", f"{rec.id}: {exc}") from None
        except UPSTREAM_READ_ERRORS as exc:
            self._fleet.proxy_failure(rec, f"{type(exc).__name__}: {exc}")
            raise Retry("disconnect", f"{rec.id}: {type(exc).__name__}: {exc}") from None

    async def _first(self, a: Attempt, up: UpstreamResponse, sse: bool) -> tuple[bytes, bool]:
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

    def _fit(self, ctx: RequestContext, rec: ReplicaRecord, flight: Flight, at: float | None) -> None:
        """The first byte arrived at ``at`` (the TTFT model's clock): the flight's prefill is done
        and the replica's model fitted. Run once the first bytes are on their way to the client
        (the fit and the headers took ~0.3 ms at idle before they were). Until it runs the
        flight's prefill still counts as pending: a decision made meanwhile (only possible when
        the first write waits for the client to drain, aiohttp buffering headers and a chunk
        below 64 KiB) sees one prefill more than the replica has."""
        sample = flight.first_byte(at)
        self._fleet.flights_changed(rec)
        if sample is not None:  # the TTFT model's prediction at dispatch, and what came
            ctx.log["predicted_first_byte_ms"] = round(sample.predicted_ms, 3)
            ctx.log["first_byte_ms"] = round(sample.observed_ms, 3)

    def _others(self, a: Attempt) -> bool:
        """Whether a replica other than the attempt's is healthy and may take its request (the
        same candidates as the router's: the model's, narrowed to an adapter's holders)."""
        if not a.may_retry:
            return False
        f, rid = a.features, a.record.id
        return any(
            r.healthy and r.id != rid for r in self._fleet.candidates(f.model, f.lora, frozenset({rid}))
        )

    def _no_first_byte(self, a: Attempt, wait: FirstByteWait) -> NoReturn:
        """The attempt's first-byte wait ended (too long, or its replica was ejected): fail it
        over (``Retry``) or, with no retry left or no other healthy replica, 504."""
        rec = a.record
        if wait.ejected:
            why, reason = "was ejected before its first byte", "ejected"
        else:
            why, reason = f"sent no first byte in {_first_byte_limit(a)}s", "first_byte_timeout"
            self._fleet.proxy_failure(rec, why)
        if self._others(a):  # may retry, and another replica can take it
            raise Retry(reason, f"{rec.id} {why}") from None
        raise RequestError(f"replica {rec.id} {why}", status=504, code="upstream_timeout") from None

    def _audit(self, a: Attempt, audit: AttemptAudit, use: Usage | None) -> None:
        reported = use.reported_cached if use is not None else None
        if use is None or reported is None:
            return
        if a.choice.predicted_tokens != reported and audit.waiting():
            # its prompt's whole keys are being encoded (after routing): audited once known
            self._late_audits.start(self._audit_encoded(a, audit, use), name="kvgate-late-audit")
        else:
            cause = self._record_audit(a, audit, use)
            if cause is not None:
                a.ctx.log["audit_cause"] = cause
                if audit.full_keys is not None:  # a deferred encode's keys, checked by the cause
                    a.ctx.log["audit_full_key_blocks"] = len(audit.full_keys)
        f, sink = a.features, self._fleet.held_prefix_sink
        hint = held_prefix_hint(f.block_keys, a.info.token_ids, f.block_size, reported) if sink else None
        if sink is not None and hint is not None:
            sink(a.record.id, *hint)
        a.ctx.log["reported_cached_tokens"] = reported

    async def _audit_encoded(self, a: Attempt, audit: AttemptAudit, use: Usage) -> None:
        """The audit of an attempt whose whole keys were still being encoded (its access-log
        line has gone out: the cause is in the metrics and ``/admin/replicas`` only)."""
        await audit.encoded(LATE_AUDIT_S)
        self._record_audit(a, audit, use)

    def _record_audit(self, a: Attempt, audit: AttemptAudit, use: Usage) -> str | None:
        """Count the attempt's audit; the cause of an inexact prediction (None: exact)."""
        predicted, reported, cause = a.choice.predicted_tokens, use.reported_cached, None
        assert reported is not None
        if predicted != reported:
            case = audit.case(a.features, a.record, predicted, use)
            cause = inexact_cause(self._fleet.index, a.record.id, case)
        record_audit(self._metrics, a.record, predicted, reported, cause)
        return cause

    async def send(self, a: Attempt, sending: Sending) -> web.StreamResponse:
        """Finish sending the request to the attempt's replica (``sending``: ``start``) and answer
        the client (raises ``Retry``, or ``RequestError`` for a replica too slow to answer)."""
        ctx, rec, features = a.ctx, a.record, a.features
        predicted = a.choice.predicted_tokens
        flight = self._fleet.dispatch(rec, a.dispatch, sending.at)
        out = sending.out
        assert flight.at_dispatch is not None  # Fleet.dispatch records it
        audit = AttemptAudit(a.info, flight.at_dispatch)  # before any await (its docstring)
        up: UpstreamResponse | None = None
        done = False
        try:
            wait: FirstByteWait | None = None
            try:
                others = functools.partial(self._others, a)
                async with self._watch.first_byte(rec, _first_byte_limit(a), others) as wait:
                    up = await self._post(a, out)
                    if up.status == 503 and a.may_retry:
                        raise Retry("503", f"{rec.id}: 503 Service Unavailable")
                    if up.status == 404 and features.lora is not None and self._others(a):
                        # the adapter is not loaded there (the fleet's view was stale)
                        raise Retry("404", f"{rec.id}: 404 for LoRA adapter {features.lora!r}")
                    is_sse = up.headers.get("content-type", "").startswith("text/event-stream")
                    first, complete = await self._first(a, up, is_sse)
                    ttft = ctx.elapsed()
                    # the TTFT model learns from this time once the first bytes are out (_fit)
                    fit = functools.partial(self._fit, ctx, rec, flight, self._fleet.ttft.now())
            except TimeoutError:  # the first-byte wait ended (``_first`` turns its own into RequestError)
                assert wait is not None
                self._no_first_byte(a, wait)  # raises Retry or RequestError
            headers = filter_headers(up.headers, DROP_RESPONSE)
            if ctx.state.config.proxy.debug_headers:
                headers["x-kvgate-replica"] = rec.id
                headers["x-kvgate-matched-tokens"] = str(predicted)
            self._metrics.ttft_by(rec.id).observe(ttft)
            ctx.log["ttft_ms"] = round(ttft * 1000, 3)
            if not is_sse and complete:
                fit()  # (the body goes out after the handler returns)
                done = True
                if up.status < 500:
                    self._fleet.proxy_success(rec)
                elif up.status != 503:
                    self._fleet.proxy_failure(rec, f"answered {up.status}")
                if up.status == 200:
                    use = usage_in(first, False)  # parsed once, for the audit and the sink
                    if up.content_type == "application/json":
                        self._audit(a, audit, use)
                    if self.outcomes is not None:
                        self.outcomes.answered(a, use)
                self._metrics.e2e_by(rec.id).observe(ctx.elapsed())
                return web.Response(status=up.status, body=first, headers=headers)
            # an SSE stream, or a body too large to hold: passed through as it arrives
            resp, done = await self._stream(a, audit, up, (first, is_sse, fit), headers)
            return resp
        finally:
            # a stream read to its end measures the replica's pace of output tokens; a body's
            # first byte came with its last, and a cut stream's end says nothing of it
            flight.end(self._fleet.ttft.now() if done and is_sse else None)
            self._fleet.flights_changed(rec)
            if up is not None:
                if done:
                    up.release()  # read to the end: the connection goes back to the pool
                else:
                    up.close()  # unread bytes, or a cancelled request: the replica sees it close

    async def _stream(
        self,
        a: Attempt,
        audit: AttemptAudit,
        up: UpstreamResponse,
        start: tuple[bytes, bool, Callable[[], None]],
        headers: CIMultiDict[str],
    ) -> tuple[web.StreamResponse, bool]:
        """Pass the response through as it arrives (``start``: its first bytes, whether it is an
        SSE stream, and the TTFT model's fit of their arrival, run once they are sent or the relay
        ends); True when the upstream was read to its end.

        A failure mid-stream ends an SSE stream with an error event; any other body is cut (the
        connection is closed, so the client sees a truncated response, not a complete one)."""
        ctx, rec, request = a.ctx, a.record, a.ctx.request
        first, sse, fit = start
        idle_s = ctx.state.config.proxy.stream_idle_timeout_s
        resp = RelayResponse(status=up.status, headers=headers)
        try:
            writer = await resp.prepare(request)
        except BaseException:
            fit()
            raise
        assert writer is not None
        # the tail of an SSE answer is kept for the audit (and the outcome sink)
        tail = SseTail(first) if sse and up.status == 200 else None
        sent = 0
        complete = False
        # one idle timer per stream (gateway/stream_relay.py), not a timeout context per chunk
        watch = IdleWatch(up.content, idle_s)
        relay: DirectRelay | ChunkRelay | None = None
        fitted = False
        try:
            await writer.write(first)  # the headers go out with the first bytes
            fit()  # the first bytes are out: now the fit (its time is their arrival)
            fitted, sent = True, len(first)
            try:
                # the rest: from the replica connection's callback when the client's response is
                # chunked as it comes (no task switch per chunk), else through aiohttp's writer
                body = up.content
                relay = DirectRelay.over(writer, body, watch, tail) or ChunkRelay(body, writer, watch, tail)
                await relay.run()
            except (TimeoutError, *UPSTREAM_READ_ERRORS) as exc:
                timed_out = isinstance(exc, TimeoutError)
                what = "timed out" if timed_out else f"failed ({type(exc).__name__})"
                ctx.log["error"] = f"upstream {what} mid-stream"
                self._fleet.proxy_failure(rec, f"{what} mid-stream: {exc}")
                if not sse:
                    # the client must not take a cut body for a whole one
                    if request.transport is not None:
                        request.transport.close()
                else:
                    status, code = (504, "upstream_timeout") if timed_out else (502, "upstream_error")
                    await resp.write(sse_error_event(status, f"replica {rec.id} {what} mid-stream", code))
                    await resp.write_eof()
            else:
                complete = True
                self._fleet.proxy_success(rec)
                # a body too large to hold is passed on unread: its outcome has no usage
                use = usage_in(tail.value(), sse) if tail is not None else None  # parsed once
                if tail is not None:
                    self._audit(a, audit, use)
                if self.outcomes is not None and up.status == 200:
                    self.outcomes.answered(a, use)
                await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError, ClientGone):
            ctx.log["error"] = "client disconnected"
        finally:
            watch.close()
            if not fitted:
                fit()  # the first write failed: its arrival is still an observation
            if relay is not None:  # ended (``run`` ends a direct relay however it returns)
                sent += relay.sent
        ctx.log["bytes_out"] = sent
        self._metrics.e2e_by(rec.id).observe(ctx.elapsed())
        return resp, complete
