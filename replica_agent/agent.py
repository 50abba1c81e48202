"""The replica agent: engine events and load in, the gateway's inventory stream out.

Tasks and their owner (``Agent.run``), stopped in this order when ``stop`` is set: the gateway
stream (so the gateway sees the stream end before anything else), the load probe, the event
subscriber; then the ZMQ context, the optional metrics endpoint and the HTTP session are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import aiohttp
import zmq.asyncio
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proto.kvgate.v1 import inventory_pb2 as pb
from replica_agent.agent_metrics import agent_registry
from replica_agent.engine_models import engine_models
from replica_agent.gateway_client import GatewayClient, HelloInfo, Link, Sources
from replica_agent.inventory import AgentInventory
from replica_agent.load_probe import EngineLoad, MetricsParseError, parse_engine_metrics
from replica_agent.outbox import Outbox
from replica_agent.subscriber import EventSubscriber

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AgentConfig:
    replica_id: str
    engine_url: str
    events: str
    gateway: str
    replay: str | None = None
    token: str | None = None
    tls_ca: bytes | None = None
    model: str | None = None  # default: the engine's first model in /v1/models
    block_size: int | None = None  # default: the engine's /metrics, else the first event
    key_block_size: int | None = None  # key granularity (the gateway's block size); default block_size
    capacity_blocks: int | None = None  # default: the engine's /metrics, else unknown
    advertise_url: str | None = None  # URL the gateway routes to (default engine_url)
    topic: str = ""
    max_blocks: int = 2_000_000  # engine hash -> key map bound
    max_outbox_events: int = 100_000
    load_interval_s: float = 1.0
    models_interval_s: float = 1.0  # polls /v1/models for loaded LoRA adapters (0: never)
    replay_timeout_s: float = 1.0
    seed: int = 0
    backoff_max_s: float = 1.0
    engine_kind: str = field(default="")
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # serve the agent's Prometheus metrics (0: any free port)


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.outbox = Outbox(cfg.max_outbox_events)
        self.inventory: AgentInventory | None = None
        self.subscriber: EventSubscriber | None = None
        self.client: GatewayClient | None = None
        self.models: list[str] = []
        self.adapters: frozenset[str] | None = None  # LoRA adapters loaded (None: not known yet)
        self.engine_version = ""
        self.load: EngineLoad | None = None
        self.probe_errors = 0
        self.ready = asyncio.Event()  # subscribed to the engine's events
        self.metrics_address = ""  # HOST:PORT of /metrics once served

    # ------------------------------------------------------------------ providers for the client
    def _hello(self) -> HelloInfo | None:
        inv = self.inventory
        if inv is None or inv.block_size is None:
            return None
        if self.subscriber is not None and self.subscriber.rekey_pending:
            return None  # the hello waits for the keys of the new block size
        load = self.load
        capacity = self.cfg.capacity_blocks or (load.capacity_blocks if load else None) or 0
        inv.capacity_blocks = capacity
        engine = self.cfg.engine_kind or (load.engine if load and load.engine else "vllm")
        return HelloInfo(
            replica_id=self.cfg.replica_id,
            url=self.cfg.advertise_url or self.cfg.engine_url,
            models=self.models,
            block_size=inv.reported_block_size or inv.block_size,
            capacity_blocks=capacity,
            engine=engine,
            engine_version=self.engine_version,
        )

    def _gateway_block_size(self, key_block_size: int) -> bool:
        """The gateway keys this replica's model at ``key_block_size`` tokens: re-key at that size
        when the engine's block (page) divides it, so that the keys match the gateway's (an engine
        page smaller than the gateway's block, e.g. SGLang's default page of 1 token)."""
        inv, sub = self.inventory, self.subscriber
        if inv is None or sub is None or inv.block_size is None:
            return False
        if inv.reported_block_size == key_block_size or key_block_size % inv.block_size:
            return False  # already there, or a size the engine cannot be keyed at (gateway refuses)
        sub.request_rekey(key_block_size)
        return True

    def _state(self) -> pb.AgentState:
        inv = self.inventory
        sub = self.subscriber
        assert inv is not None and sub is not None
        return pb.AgentState(
            degraded=inv.degraded,
            reason=inv.degraded_reason,
            engine_gaps=sub.stats.gaps,
            unrecovered_gaps=sub.stats.unrecovered_gaps,
            skipped_blocks=inv.stats.skipped_blocks,
        )

    def _engine(self) -> pb.EngineState:
        inv = self.inventory
        adapters = self.adapters
        return pb.EngineState(
            hybrid=inv is not None and inv.hybrid,
            lora_adapters=sorted(adapters or ()),
            adapters_known=adapters is not None,
        )

    def _load(self) -> pb.Load | None:
        ld = self.load
        if ld is None:
            return None
        return pb.Load(
            running=ld.running,
            waiting=ld.waiting,
            kv_usage=ld.kv_usage,
            prefix_queries=ld.prefix_queries,
            prefix_hits=ld.prefix_hits,
        )

    # ------------------------------------------------------------------ engine HTTP
    async def _discover(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> str:
        """The model name that roots block keys: the configured one, else the engine's first."""
        base = self.cfg.engine_url.rstrip("/")
        while True:
            try:
                async with http.get(f"{base}/v1/models") as resp:
                    if resp.status == 200:
                        listed = engine_models(await resp.json())
                        self.models = list(listed.models)
                        # not followed (--models-interval 0): unknown rather than stale
                        self.adapters = listed.adapters if self.cfg.models_interval_s > 0 else None
                with contextlib.suppress(aiohttp.ClientError, ValueError, asyncio.TimeoutError):
                    async with http.get(f"{base}/version") as resp:
                        if resp.status == 200:
                            self.engine_version = str((await resp.json()).get("version", ""))
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                log.info("engine %s not answering yet: %s", base, exc)
            if self.cfg.model:
                if self.cfg.model not in self.models:
                    self.models = [self.cfg.model, *self.models]
                return self.cfg.model
            if self.models:
                return self.models[0]
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            if stop.is_set():
                raise asyncio.CancelledError

    async def _probe(self, http: aiohttp.ClientSession) -> None:
        url = f"{self.cfg.engine_url.rstrip('/')}/metrics"
        while True:
            try:
                async with http.get(url) as resp:
                    text = await resp.text()
                    if resp.status == 200:
                        self.load = parse_engine_metrics(text)
                        inv = self.inventory
                        if inv is not None and inv.block_size is None and self.load.block_size:
                            inv.block_size = self.load.block_size
                        self.outbox.wake.set()
            except (TimeoutError, aiohttp.ClientError, MetricsParseError, UnicodeDecodeError) as exc:
                self.probe_errors += 1
                log.debug("load probe failed: %s", exc)
            await asyncio.sleep(self.cfg.load_interval_s)

    async def _watch_models(self, http: aiohttp.ClientSession) -> None:
        """Polls ``/v1/models`` for the engine's loaded LoRA adapters (they change on load and
        unload); a change wakes the stream, which then sends the EngineState."""
        url = f"{self.cfg.engine_url.rstrip('/')}/v1/models"
        while True:
            await asyncio.sleep(self.cfg.models_interval_s)
            try:
                async with http.get(url) as resp:
                    if resp.status != 200:
                        continue
                    adapters = engine_models(await resp.json()).adapters
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                log.debug("/v1/models poll failed: %s", exc)
                continue
            if adapters != self.adapters:
                log.info("engine adapters now %s", sorted(adapters))
                self.adapters = adapters
                self.outbox.wake.set()

    async def _serve_metrics(self) -> web.AppRunner:
        registry = agent_registry(self)

        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.cfg.metrics_host, self.cfg.metrics_port)
        await site.start()
        host, port = runner.addresses[0][:2]
        self.metrics_address = f"{host}:{port}"
        return runner

    # ------------------------------------------------------------------ run
    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.cfg
        timeout = aiohttp.ClientTimeout(total=5.0, connect=2.0)
        ctx = zmq.asyncio.Context()
        tasks: list[asyncio.Task[None]] = []
        # the metrics endpoint is started first and closed after the ZMQ context, before the HTTP
        # session (the module docstring's order)
        metrics_runner = await self._serve_metrics() if cfg.metrics_port is not None else None
        async with aiohttp.ClientSession(timeout=timeout) as http:
            try:
                # the probe first: it may tell the block size before the engine has sent any event
                tasks.append(asyncio.create_task(self._probe(http), name="agent-probe"))
                try:
                    model = await self._discover(http, stop)
                except asyncio.CancelledError:
                    if stop.is_set():
                        return
                    raise
                self.inventory = AgentInventory(
                    model, cfg.block_size, cfg.max_blocks, sink=self.outbox, key_block_size=cfg.key_block_size
                )
                if self.load is not None and cfg.block_size is None and self.load.block_size:
                    self.inventory.block_size = self.load.block_size

                def on_applied(ts: float) -> None:
                    self.outbox.engine_ts = ts

                self.subscriber = EventSubscriber(
                    ctx,
                    cfg.events,
                    cfg.replay,
                    self.inventory,
                    topic=cfg.topic.encode(),
                    replay_timeout_s=cfg.replay_timeout_s,
                    on_applied=on_applied,
                )
                self.client = GatewayClient(
                    Link(
                        cfg.gateway,
                        token=cfg.token,
                        tls_ca=cfg.tls_ca,
                        seed=cfg.seed,
                        backoff_max_s=cfg.backoff_max_s,
                    ),
                    Sources(
                        self.inventory,
                        self.outbox,
                        self._hello,
                        state=self._state,
                        load=self._load,
                        engine=self._engine,
                        on_key_block_size=self._gateway_block_size,
                    ),
                )
                tasks.insert(0, asyncio.create_task(self.subscriber.run(), name="agent-subscriber"))
                if cfg.models_interval_s > 0:
                    tasks.append(asyncio.create_task(self._watch_models(http), name="agent-models"))
                tasks.insert(0, asyncio.create_task(self.client.run(), name="agent-gateway"))
                self.ready.set()
                # the readiness line scripts and tests wait for (stdout, one line)
                print(
                    f"kvgate agent ready replica={cfg.replica_id} model={model} events={cfg.events} "
                    f"gateway={cfg.gateway} metrics={self.metrics_address or '-'}",
                    flush=True,
                )
                log.info(
                    "agent %s: model %s, events %s, replay %s, gateway %s",
                    cfg.replica_id,
                    model,
                    cfg.events,
                    cfg.replay,
                    cfg.gateway,
                )
                stopper = asyncio.create_task(stop.wait())
                done, _ = await asyncio.wait({stopper, *tasks}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                for t in done:
                    exc = None if t is stopper or t.cancelled() else t.exception()
                    if exc is not None:
                        raise exc
            finally:
                # order: gateway stream, probe, subscriber (tasks holds them in that order once started)
                ordered = sorted(
                    tasks, key=lambda t: {"agent-gateway": 0, "agent-probe": 1}.get(t.get_name(), 2)
                )
                for t in ordered:
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t
                ctx.destroy(linger=0)
                if metrics_runner is not None:
                    await metrics_runner.cleanup()
