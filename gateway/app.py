"""The composition root: the one place that builds the gateway's parts and owns their lifetimes.

Build order: config -> prefix index -> fleet -> policy -> featurizer -> proxy -> inventory server
-> shared state (Redis, only with ``shared_state.redis_url``) -> health checker -> telemetry
(metrics registry, tracing, access log).

Start order: client session, inventory server, shared state (Redis; never waits for it), one
health round (so /ready reflects the fleet before traffic arrives), background loops (health,
index expiry), then the HTTP listener.

Shutdown order (``stop``), the reverse: ``/ready`` answers 503 first (``server.drain_delay_s``,
so load balancers stop sending while requests are still served), then the HTTP listener closes
(no new requests; in-flight ones get ``server.shutdown_grace_s`` to finish), then the health
loop, the index expiry loop, the inventory server (agents reconnect elsewhere or later), the
operator view, the shared state (after the inventory server, whose hooks feed it), the featurizers (worker threads, remote-tokenize session), the upstream client session, and
tracing last so the final spans are flushed. Every background task is created here and cancelled
and awaited here.

With a ``link`` (``kvgate serve --workers N``; docs/architecture.md, "Workers"): the parent's app
starts no HTTP listener, a worker's no inventory server, shared state or health checker (its
index comes from the parent); the link starts after them and stops before the inventory server.

Reload (SIGHUP or ``POST /admin/reload``) rereads the file, validates it, builds the new policy
and featurizer, then swaps ``self._state`` in one assignment and reconfigures the fleet's static
replicas. An invalid file changes nothing. Fields that need a restart (listen addresses, index
bounds, inventory, shared state, OTLP endpoint, auth variable names) are reported, not applied.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.access_log import AccessLog, configure_logging
from gateway.admin import Admin
from gateway.api_keys import api_auth_middlewares
from gateway.app_parts import build_inventory_server, build_state, env_token, wire_shared_state
from gateway.asyncio_tasks import TaskSet, cancel_and_wait
from gateway.config import GatewayConfig, load_config
from gateway.features import Featurizer
from gateway.features.budgets import MemoryCollector
from gateway.fleet import Fleet
from gateway.health import HealthChecker
from gateway.http_server import HardenedRunner, raise_fd_limit
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import error_response, openai_errors_middleware
from gateway.operator_view import OperatorView, with_observer
from gateway.proxy import Proxy, ProxyParts
from gateway.routing import Router, RoutingState
from gateway.shared_state import SharedState
from gateway.status_page import StatusPage
from gateway.tls import http_ssl_context
from gateway.tracing import Tracing
from gateway.upstream_client import UpstreamClient
from gateway.workers_link import AppLink
from router_policies.errors import UserInputError
from router_policies.placement import EXPIRE_INTERVAL_S
from router_policies.prefix_index import PrefixIndex

log = logging.getLogger("kvgate.app")

_RESTART_ONLY = ("listen", "server", "index", "inventory", "shared_state", "auth")
RETIRE_GRACE_S = 5.0


class GatewayApp:
    def __init__(
        self,
        config: GatewayConfig,
        config_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        shutdown_grace_s: float | None = None,
        link: AppLink | None = None,
    ) -> None:
        """``shutdown_grace_s`` overrides ``server.shutdown_grace_s``; ``link``: this process's
        part in a gateway of several (None: the whole gateway in one process)."""
        self._env = dict(os.environ if env is None else env)
        self._config_path = Path(config_path) if config_path is not None else None
        self._grace = config.server.shutdown_grace_s if shutdown_grace_s is None else shutdown_grace_s
        self._draining = False  # set first on shutdown: /ready answers 503
        self._link = link
        self.index = PrefixIndex(config.index)
        self.fleet = Fleet(config, self.index) if link is None else link.make_fleet(config, self.index)
        self._state = build_state(config, remote=self.fleet.tokenize_url)
        self.router = Router(self.index, self.fleet)
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(
            self.registry, self.index, self.fleet, lambda: self._state.featurizer.cache_stats()
        )
        self.registry.register(MemoryCollector(self._memory_stats))
        self.tracing = Tracing(config.telemetry.otlp_endpoint)
        self.access_log = AccessLog()
        self.inventory = build_inventory_server(
            config,
            self._env,
            self.index,
            self.fleet,
            self.registry,
            lambda: {r.id for r in self.config.replicas},
        )
        self.fleet.held_prefix_sink = self.inventory.held_prefix
        self.shared_state: SharedState | None = None
        if config.shared_state.redis_url:
            self.shared_state = wire_shared_state(
                config, self.index, self.fleet, self.inventory, self.registry
            )
        self.operator = OperatorView(
            config.operator, self.registry, lambda: [r.id for r in self.fleet.records()]
        )
        self.inventory.observer = with_observer(self.inventory.observer, self.operator.lifetime)
        self._admin_token = env_token(config.auth.admin_token_env, self._env)
        self._api_auth = api_auth_middlewares(config.auth.api_keys, self._env, self.registry)
        self._http_ssl = http_ssl_context(config.auth.http_tls)
        self._session: aiohttp.ClientSession | None = None
        self._client: UpstreamClient | None = None  # the request path's (gateway/upstream_client.py)
        self._proxy: Proxy | None = None
        self._health: HealthChecker | None = None
        self._expire_task: asyncio.Task[None] | None = None
        # featurizers replaced by a reload, closed once the requests featurizing with them are done
        self._retiring = TaskSet()  # featurizers replaced by a reload, closed after a grace
        self._runner: web.AppRunner | None = None
        self.http_port = 0
        self.inventory_port = 0
        if link is not None:
            link.attach(self)

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> RoutingState:
        return self._state

    @property
    def config(self) -> GatewayConfig:
        return self._state.config

    def reload(self) -> str | None:
        """Reread and apply the config file; returns None, or the error (nothing changed)."""
        if self._config_path is None:
            return "the gateway was started without a config file"
        try:
            new = load_config(self._config_path, self._env)
            state = build_state(new, remote=self.fleet.tokenize_url, previous=self._state)
        except UserInputError as exc:
            self.metrics.reloads.labels("rejected").inc()
            log.error("config reload rejected, the running config stays: %s", exc)
            return str(exc)
        old = self._state.config
        pending = [k for k in _RESTART_ONLY if getattr(old, k) != getattr(new, k)]
        if old.telemetry.otlp_endpoint != new.telemetry.otlp_endpoint:
            pending.append("telemetry.otlp_endpoint")
        previous = self._state
        self._state = state  # the atomic swap: requests read the state once at their start
        if state.featurizer is not previous.featurizer:
            self._retire(previous.featurizer)
        self.fleet.reconfigure(new)
        self.operator.reconfigure(new.operator)
        configure_logging(new.telemetry.log_level, new.telemetry.access_log)
        self.metrics.reloads.labels("applied").inc()
        if self._link is not None:
            self._link.reloaded()
        if pending:
            log.warning("config reloaded; changes to %s apply after a restart", ", ".join(pending))
        else:
            log.info("config reloaded (policy %s)", state.policy.name)
        return None

    def _memory_stats(self) -> dict[str, tuple[int, int]]:
        """Bytes held and their bounds, per holder clients fill (``kvgate_memory_bytes``)."""
        proxy = self._proxy.memory_stats() if self._proxy is not None else {}
        return {**self._state.featurizer.memory_stats(), **proxy}

    def _retire(self, featurizer: Featurizer) -> None:
        async def close_later() -> None:
            # features are computed at a request's start, in milliseconds: after this grace no
            # request still uses the old featurizer
            await asyncio.sleep(RETIRE_GRACE_S)
            await featurizer.close()

        self._retiring.start(close_later(), name="kvgate-retire-featurizer")

    # ------------------------------------------------------------------ HTTP
    def _web_app(self) -> web.Application:
        assert self._proxy is not None
        p = self._proxy
        admin = Admin(
            lambda: self._state, lambda: self._admin_token, self, self.router, self.fleet, self.index
        )
        # only admin bodies use aiohttp's reader; the proxy reads bodies itself (proxy.max_body_bytes)
        app = web.Application(
            client_max_size=1024 * 1024, middlewares=[openai_errors_middleware, *self._api_auth]
        )
        app.add_routes(
            [
                web.post("/v1/completions", p.completions),
                web.post("/v1/chat/completions", p.chat_completions),
                web.get("/v1/models", p.models),
                web.get("/health", self._health_endpoint),
                web.get("/ready", self._ready),
                web.get("/metrics", self._metrics_endpoint),
                *admin.routes(),
                *self.operator.routes(admin._guard),
                *StatusPage().routes(),
            ]
        )
        if self._link is not None:
            self._link.setup_web(app)
        return app

    async def _health_endpoint(self, _request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})

    async def _ready(self, _request: web.Request) -> web.StreamResponse:
        if self._draining:
            return error_response(503, "the gateway is shutting down", code="draining")
        if self.fleet.any_healthy():
            return web.json_response({"status": "ready"})
        return error_response(503, "no healthy replica", code="not_ready")

    async def _metrics_endpoint(self, _request: web.Request) -> web.StreamResponse:
        if not self._state.config.telemetry.metrics:
            return error_response(404, "metrics are disabled (telemetry.metrics)")
        body = generate_latest(self.registry) if self._link is None else await self._link.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ lifecycle
    async def _expire_loop(self) -> None:
        """Housekeeping each second: expired approximate index entries, replicas long gone."""
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_S)
            now = time.monotonic()
            self.index.expire(now)
            for rid in self.fleet.forget_stale(now, self._state.config.health.forget_after_s):
                log.warning("replica %s forgotten: its agent is gone and it stayed unhealthy", rid)

    async def start(self, http: str | None = None, inventory: str | None = None) -> None:
        cfg = self._state.config
        configure_logging(cfg.telemetry.log_level, cfg.telemetry.access_log)
        raise_fd_limit()
        loop = asyncio.get_running_loop()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=60),
            auto_decompress=False,  # bytes pass through as the replica sent them
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
        )
        self._client = UpstreamClient()
        parts = ProxyParts(
            self.router,
            self.fleet,
            self._session,
            self._client,
            self.metrics,
            self.tracing,
            self.access_log,
            outcomes=self.operator,
        )
        self._proxy = Proxy(lambda: self._state, parts)
        await self.operator.start()
        worker = self._link is not None and self._link.worker is not None
        if not worker:  # a worker's index and health come from the parent (gateway/local_hub.py)
            inv_addr = inventory or cfg.listen.inventory
            try:
                self.inventory_port = await self.inventory.start(inv_addr)
            except RuntimeError as exc:  # grpc reports a port it cannot bind this way
                raise OSError(f"inventory {inv_addr}: {exc}") from None
            if self.shared_state is not None:
                await self.shared_state.start()
            self._health = HealthChecker(self.fleet, self._session, lambda: self._state.config.health)
            await self._health.start()
        if self._link is not None:
            await self._link.start()
        self._expire_task = loop.create_task(self._expire_loop(), name="kvgate-index-expiry")
        if self._link is not None and not worker:
            return  # the parent of workers serves no API
        self._runner = HardenedRunner(
            self._web_app(),
            cfg.server,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self._grace,
        )
        await self._runner.setup()
        host, _, port = (http or cfg.listen.http).rpartition(":")
        # workers each bind the one port (SO_REUSEPORT): the kernel spreads connections over them
        site = web.TCPSite(self._runner, host, int(port), ssl_context=self._http_ssl, reuse_port=worker)
        await site.start()
        addrs = self._runner.addresses
        self.http_port = int(addrs[0][1]) if addrs else int(port)

    async def stop(self) -> None:
        self._draining = True
        if self._runner is not None:
            delay = self._state.config.server.drain_delay_s
            if delay:
                log.info("draining: /ready answers 503 for %ss before the listener closes", delay)
                await asyncio.sleep(delay)
            await self._runner.cleanup()
            self._runner = None
        if self._health is not None:
            await self._health.stop()
            self._health = None
        if self._expire_task is not None:
            await cancel_and_wait(self._expire_task)
            self._expire_task = None
        if self._link is not None:
            await self._link.stop()
        await self.inventory.stop()
        await self.operator.stop()
        if self.shared_state is not None:
            await self.shared_state.stop()
        await self._retiring.stop()
        if self._proxy is not None:
            await self._proxy.stop()  # late audits wait on the featurizer's encodes: before it
        await self._state.featurizer.close()
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.tracing.shutdown()
