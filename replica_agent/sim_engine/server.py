"""Composition root of the simulated engine and its start/stop order.

Start: tokenizer and model (sync), publisher sockets bound, core task, HTTP site; then one ready
line on stdout naming the bound addresses (ports given as 0 are resolved there).
Stop (SIGTERM/SIGINT): the core first (it fails every outstanding request, so handlers finish
and new ones get 503), then the HTTP runner (closes connections), then the tokenizer's thread
and the request log (only HTTP handlers use them), then the publisher (replay task, sockets,
contexts). Each background task has exactly one owner that cancels and awaits it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aiohttp import web

from replica_agent.sim_engine import protocol as proto
from replica_agent.sim_engine.block_registry import BlockRegistry
from replica_agent.sim_engine.core import CoreHooks, EngineCore
from replica_agent.sim_engine.http_api import Deps, Routes, errors_middleware
from replica_agent.sim_engine.kv_events import KvEventPublisher
from replica_agent.sim_engine.metrics import EngineMetrics
from replica_agent.sim_engine.options import EngineOptions
from replica_agent.sim_engine.request_log import RequestLog
from replica_agent.sim_engine.tokenization import EngineTokenizer
from router_policies.sim.profiles import get_profile
from router_policies.sim.replica_model import EngineConfig, ReplicaModel, StepCosts

_CLIENT_MAX_SIZE = 32 * 1024 * 1024  # request bodies; prompts are bounded by max_model_len anyway


@dataclass(frozen=True, slots=True)
class BoundAddresses:
    http: str
    events: str
    replay: str | None


def engine_config(opts: EngineOptions) -> EngineConfig:
    profile = get_profile(opts.profile)
    base = profile.engine_config(opts.block_size, opts.cache_blocks)
    s = opts.time_scale
    c = base.costs
    costs = StepCosts(
        step_overhead_s=c.step_overhead_s * s,
        prefill_s_per_token=c.prefill_s_per_token * s,
        prefill_s_per_token_ctx=c.prefill_s_per_token_ctx * s,
        decode_s_per_seq=c.decode_s_per_seq * s,
        decode_s_per_ctx_token=c.decode_s_per_ctx_token * s,
    )
    return dataclasses.replace(
        base,
        costs=costs,
        max_num_seqs=opts.max_num_seqs or base.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens or base.max_num_batched_tokens,
    )


def _zmq_endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port if port else '*'}"


class SimEngine:
    def __init__(self, opts: EngineOptions) -> None:
        self.opts = opts
        self.tokenizer = EngineTokenizer(opts.tokenizer)
        self.model = ReplicaModel(engine_config(opts))
        self.registry = BlockRegistry(opts.model, opts.block_size, opts.hash_format)
        self.metrics = EngineMetrics(self.model, opts.model)
        self.publisher = KvEventPublisher(
            endpoint=_zmq_endpoint(opts.host, opts.events_port),
            replay_endpoint=None if opts.replay_port is None else _zmq_endpoint(opts.host, opts.replay_port),
            topic=opts.topic,
            replay_buffer=opts.replay_buffer,
            encoding=opts.event_encoding,
        )
        self._core: EngineCore | None = None
        self._runner: web.AppRunner | None = None
        # the requests' tokenization (http_api.Deps.tokenize_pool); shut down after the HTTP
        # site, which is the only one to submit to it
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.request_log = RequestLog(opts.request_log) if opts.request_log is not None else None

    async def start(self) -> BoundAddresses:
        opts = self.opts
        self.publisher.start()
        core = EngineCore(
            self.model,
            self.registry,
            self.publisher,
            opts.max_pending,
            CoreHooks(
                on_first_token=self.metrics.observe_ttft,
                on_finished=lambda h: self.metrics.request_finished(h.prompt_len, h.produced),
                on_preempted=self.metrics.preempted,
            ),
        )
        self._core = core
        core.start()
        app = web.Application(middlewares=[errors_middleware], client_max_size=_CLIENT_MAX_SIZE)
        limits = proto.ServingLimits(opts.model, opts.max_model_len, opts.default_max_tokens)
        deps = Deps(
            tokenizer=self.tokenizer,
            tokenize_pool=self._tokenize_pool,
            limits=limits,
            core=core,
            model=self.model,
            publisher=self.publisher,
            metrics=self.metrics,
            seed=opts.seed,
            model_root=str(opts.tokenizer),
            started=proto.now_s(),
            request_log=self.request_log,
        )
        Routes(deps).add_to(app)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, opts.host, opts.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        return BoundAddresses(
            http=f"http://{host}:{port}",
            events=self.publisher.bound_endpoint(),
            replay=self.publisher.bound_replay_endpoint(),
        )

    async def stop(self) -> None:
        if self._core is not None:
            await self._core.stop()
            self._core = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._tokenize_pool.shutdown(wait=True, cancel_futures=True)
        if self.request_log is not None:
            self.request_log.close()
        await self.publisher.close()


async def serve(opts: EngineOptions) -> int:
    engine = SimEngine(opts)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        bound = await engine.start()
        cfg = engine.model.config
        print(
            f"sim-engine ready http={bound.http} events={bound.events} replay={bound.replay or '-'} "
            f"model={opts.model} block_size={cfg.block_size} cache_blocks={cfg.num_blocks} "
            f"profile={opts.profile} time_scale={opts.time_scale:g}",
            flush=True,
        )
        await stop.wait()
    finally:
        await engine.stop()
    print("sim-engine stopped", file=sys.stderr, flush=True)
    return 0
