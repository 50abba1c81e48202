"""The HTTP listener's protection against slow, idle and too many clients, and OpenAI-shaped
answers to errors aiohttp's parser raises before any handler runs (docs/gateway.md, "Errors" and
"Timeouts"; docs/architecture.md).

What Envoy and HAProxy do, on aiohttp's server (``server.*`` in the config):

- ``header_timeout_s``: a request's headers must arrive whole within this long of its first byte
  (HAProxy ``timeout http-request``); otherwise 408 and the connection closes;
- ``idle_timeout_s``: a connection with no request in progress closes after this long (aiohttp's
  keep-alive timeout, which also covers a connection that never sends a byte);
- the body: ``proxy.body_timeout_s``, applied where the proxy reads it (``gateway/proxy.py``);
- ``max_connections``: beyond it, or beyond the open-file limit less ``FD_RESERVE`` (sockets to
  replicas, the inventory stream, files), a new connection gets 503 and closes, so the listener
  never runs out of file descriptors for ``/health`` and the replicas;
- parser errors (bad request line, too many headers, a header too long, Transfer-Encoding with
  Content-Length...) are answered with the OpenAI error JSON and logged as one WARNING line,
  where aiohttp answers text/plain and logs an ERROR traceback.

An answer written here goes straight onto the transport (the connection then closes): no request
object exists yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from typing import Any

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_request import BaseRequest

from gateway.config import ServerConfig
from gateway.openai_errors import error_body

log = logging.getLogger("kvgate.http")

FD_RESERVE = 128  # descriptors kept for upstream sockets, the inventory stream and files


LINGER_S = 2.0  # how long a connection answered 408 is read and discarded before it closes


def connection_cap(configured: int) -> int:
    """``configured``, lowered to the open-file limit less ``FD_RESERVE`` (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(16, min(configured, soft - FD_RESERVE))


def raise_fd_limit() -> None:
    """Raise the soft open-file limit to the hard one (as Envoy's docs advise): the connection cap
    then follows the system's real bound."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response carrying the OpenAI error JSON; the connection closes."""
    body = error_body(status, message, None, code)
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _parse_error(exc: BaseException | None, status: int) -> tuple[int, str, str]:
    """(status, message, code) of a parser error."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "?"
        return 431, f"a request line or header is longer than {limit} bytes", "header_too_large"
    if isinstance(exc, HttpProcessingError):
        text = exc.message or type(exc).__name__
        if "too many headers" in text.lower():
            return 431, "too many request headers", "too_many_headers"
        return 400, f"malformed HTTP request: {text}", "bad_http_request"
    return status, "internal gateway error", "internal_error"


class HardenedHandler(web_protocol.RequestHandler):
    """aiohttp's connection protocol plus the header timeout, the connection cap and
    OpenAI-shaped parser errors (see the module docstring)."""

    __slots__ = ("_body", "_cap", "_cfg", "_header_timer", "_lingering", "_refused")

    def __init__(self, manager: HardenedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._cfg = manager.cfg
        self._cap = manager.cap
        self._header_timer: asyncio.TimerHandle | None = None
        self._body: Any = None  # the payload of the last request whose headers arrived
        self._refused = False
        self._lingering = False  # a 408 was sent: what the client still sends is discarded

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        manager = self._manager
        if manager is not None and len(manager.connections) >= self._cap:
            log.warning("connection refused: %d client connections open (server.max_connections)", self._cap)
            transport.write(  # type: ignore[attr-defined]  # a (uvloop) TCP transport
                raw_error(503, "Service Unavailable", "too many client connections", "too_many_connections")
            )
            transport.close()
            self._refused = True
            return
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._refused or self._lingering:
            return
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:  # a request's headers arrived whole
            self._stop_header_timer()
            if self._messages:
                self._body = self._messages[-1][1]
        elif data and self._header_timer is None and (self._body is None or self._body.is_eof()):
            # the first bytes of a request's headers: they must all arrive in time
            self._header_timer = self._loop.call_later(self._cfg.header_timeout_s, self._headers_late)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        transport = self.transport
        if transport is None or self._force_close:
            return
        peer = transport.get_extra_info("peername")
        log.warning("request headers from %s not received in %ss: 408", peer, self._cfg.header_timeout_s)
        message = f"request headers not received in {self._cfg.header_timeout_s}s"
        transport.write(raw_error(408, "Request Timeout", message, "header_timeout"))
        # Lingering close (as nginx's lingering_close): closing at once, with the client's header
        # bytes still arriving, makes the kernel send a reset that can destroy the 408 before the
        # client reads it. So: end our side (FIN), discard what still comes, close a moment later.
        self._lingering = True
        if isinstance(transport, asyncio.WriteTransport) and transport.can_write_eof():
            transport.write_eof()
        self._loop.call_later(LINGER_S, transport.close)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_header_timer()
        if not self._refused:
            super().connection_lost(exc)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,  # noqa: ARG002  # aiohttp's signature; the JSON has its own
    ) -> web.StreamResponse:
        """One WARNING line and the OpenAI error JSON (aiohttp: an ERROR traceback and text)."""
        code_status, text, code = _parse_error(exc, status)
        if isinstance(exc, HttpProcessingError):
            log.warning("%s from %s: %s", code, request.remote, text)
        elif status == 504:
            log.warning("handler timed out on %s %s", request.method, request.path)
            code_status, text, code = 504, "the gateway timed out", "timeout"
        else:
            self.log_exception("error handling request from %s", request.remote, exc_info=exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the response was already started")
        resp = web.Response(
            status=code_status,
            body=error_body(code_status, text, None, code),
            content_type="application/json",
        )
        resp.force_close()
        return resp


class HardenedServer(web.Server):
    """aiohttp's ``Server`` building ``HardenedHandler`` connections."""

    def __init__(self, base: web.Server, cfg: ServerConfig) -> None:
        kwargs = dict(base._kwargs)
        super().__init__(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=base._loop,
            **kwargs,
        )
        self.cfg = cfg
        self.cap = connection_cap(cfg.max_connections)

    def __call__(self) -> HardenedHandler:
        return HardenedHandler(self, loop=self._loop, **self._kwargs)


class HardenedRunner(web.AppRunner):
    """``AppRunner`` whose server is a ``HardenedServer`` with ``cfg``'s limits."""

    def __init__(self, app: web.Application, cfg: ServerConfig, **kwargs: Any) -> None:
        super().__init__(
            app,
            keepalive_timeout=cfg.idle_timeout_s,
            max_headers=cfg.max_headers,
            max_line_size=cfg.max_header_bytes,
            max_field_size=cfg.max_header_bytes,
            **kwargs,
        )
        self._cfg = cfg

    async def _make_server(self) -> web.Server:
        return HardenedServer(await super()._make_server(), self._cfg)
