"""``kvgate serve --workers N``: N HTTP worker processes on one port, fed one index by the parent
(docs/architecture.md, "Workers").

The parent process is the inventory owner: a ``GatewayApp`` whose link is ``ParentLink`` runs the
agents' gRPC server, the health checker, the index expiry and the ``Hub`` (gateway/local_hub.py),
and serves no API. It reserves the HTTP port (a bound socket with SO_REUSEPORT, never listening),
then starts the workers, each ``kvgate serve`` with a ``HubClient`` link
(gateway/local_hub_client.py) binding that port with SO_REUSEPORT, so the kernel spreads
connections over them. The parent prints its ``kvgate serve: http=... inventory=...`` line once
every worker listens.

Supervision: a worker that exits is started again (backoff from ``RESTART_BASE_S`` doubling to
``RESTART_MAX_S``, reset once a worker lived ``RESTART_RESET_S``) and resyncs from the parent's
whole state. SIGHUP reloads the parent's config and relays the reload to every worker.

Shutdown (SIGTERM or SIGINT), in order: every worker gets SIGTERM and drains as one process does
(``/ready`` 503 for ``server.drain_delay_s``, then in-flight requests get
``server.shutdown_grace_s``); workers still alive ``STOP_SLACK_S`` after that are killed; then the
parent's app stops (hub, inventory server, health checker), and the socket directory is removed.

Tasks: ``Supervisor.run`` owns one supervision task per worker and cancels and awaits them at the
end; the app owns the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from aiohttp import web
from prometheus_client import Counter, Gauge, generate_latest

from gateway.app import GatewayApp
from gateway.asyncio_tasks import cancel_and_wait
from gateway.config import GatewayConfig
from gateway.fleet import Fleet
from gateway.local_hub import Hub, HubHooks, OwnerFleet
from gateway.local_hub_codec import frame
from gateway.operator_view import with_observer
from gateway.workers_shared_load import LOAD_TABLE, SharedLoad, create_table
from router_policies.errors import UserInputError
from router_policies.gc_settings import freeze_startup_heap
from router_policies.prefix_index import PrefixIndex

log = logging.getLogger("kvgate.workers")

START_TIMEOUT_S = 120.0  # every worker must listen within this long of the start
RESTART_BASE_S = 0.5
RESTART_MAX_S = 10.0
RESTART_RESET_S = 30.0
STOP_SLACK_S = 5.0


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may use: its CPU affinity, lowered to its cgroup's CPU quota
    rounded up (a container's CPU limit, which affinity does not show)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000"
    except (OSError, ValueError):
        try:  # cgroup v1
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return cores
    if quota in ("max", "-1") or not quota.lstrip("-").isdigit() or not period.isdigit() or int(period) <= 0:
        return cores
    return max(1, min(cores, math.ceil(int(quota) / int(period))))


def worker_count(flag: int | None, config: GatewayConfig) -> int:
    """``--workers``, else ``server.workers``, else the cores this process may use
    (``usable_cores``; 1 with shared state, which one process per instance serves today)."""
    n = flag if flag is not None else config.server.workers
    if n is None:
        return 1 if config.shared_state.redis_url else usable_cores()
    if n < 1:
        raise UserInputError(f"--workers: expected a positive number, got {n}")
    if n > 1 and config.shared_state.redis_url:
        raise UserInputError(
            "server.workers > 1 with shared_state.redis_url is not supported: run one worker per "
            "instance, or several instances"
        )
    return n


class ParentLink:
    """The parent's part (``gateway.workers_link.AppLink``): the hub to the workers."""

    worker = None

    def __init__(self, hub_path: str, ready: Callable[[int], None]) -> None:
        self._path = hub_path
        self._ready = ready
        self._app: GatewayApp | None = None
        self._remote_reload = False
        self.hub: Hub | None = None

    def make_fleet(self, config: GatewayConfig, index: PrefixIndex) -> Fleet:
        return OwnerFleet(config, index)

    def attach(self, app: GatewayApp) -> None:
        assert isinstance(app.fleet, OwnerFleet)
        self._app = app
        hooks = HubHooks(self._reload_for_worker, self._ready, app.inventory.held_prefix, app.registry)
        self.hub = Hub(app.index, app.fleet, hooks)
        app.inventory.observer = with_observer(app.inventory.observer, self.hub)

    def _reload_for_worker(self) -> str | None:
        """A worker reloaded (``POST /admin/reload``): the parent does too, without relaying
        it back (the hub relays it to the other workers)."""
        assert self._app is not None
        self._remote_reload = True
        try:
            return self._app.reload()
        finally:
            self._remote_reload = False

    def setup_web(self, web_app: web.Application) -> None:
        pass  # the parent serves no API

    def reloaded(self) -> None:
        if not self._remote_reload and self.hub is not None:
            self.hub.broadcast(frame(b"Q"))

    async def exposition(self) -> bytes:
        assert self._app is not None
        return generate_latest(self._app.registry)

    async def start(self) -> None:
        assert self.hub is not None
        await self.hub.start(self._path)

    async def stop(self) -> None:
        if self.hub is not None:
            await self.hub.stop()


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT and never listening: it holds the port
    (port 0: the kernel's pick) for the workers, across their restarts."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


class Supervisor:
    def __init__(self, args: argparse.Namespace, config: GatewayConfig, count: int) -> None:
        self._args = args
        self._config = config
        self._count = count
        self._dir = Path(tempfile.mkdtemp(prefix="kvgate-workers-"))
        self._listening: set[int] = set()  # workers that said they listen (bounded by count)
        self._changed = asyncio.Event()
        self._live: Gauge | None = None  # kvgate_workers, registered with the parent's app
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._stopping = False
        self._listen = ""
        # the workers' load table (gateway/workers_shared_load.py): made by ``run`` before they
        # start, a worker's rows zeroed when it exits
        self._load_table: SharedLoad | None = None

    def _command(self, number: int) -> Sequence[str]:
        return [
            sys.executable, "-m", "gateway.cli", "serve", "--config", self._args.config,
            "--listen", self._listen, "--worker-of", str(self._dir / "hub.sock"),
            "--worker-index", str(number), "--worker-count", str(self._count),
        ]  # fmt: skip

    async def _spawn(self, number: int) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(*self._command(number), stdin=asyncio.subprocess.DEVNULL)
        self._procs[number] = proc
        return proc

    async def _supervise(self, number: int, restarts: Counter) -> None:
        attempt = 0
        while True:
            proc = self._procs[number]
            started = time.monotonic()
            code = await proc.wait()
            if self._stopping:
                return
            self._listening.discard(number)
            self._count_listening()
            if self._load_table is not None:
                self._load_table.clear(number)  # its flights ended with it
            if time.monotonic() - started > RESTART_RESET_S:
                attempt = 0
            delay = min(RESTART_MAX_S, RESTART_BASE_S * 2**attempt)
            attempt = min(attempt + 1, 30)
            log.error(
                "worker %d (pid %d) exited with %s; starting it again in %.1fs", number, proc.pid, code, delay
            )
            restarts.inc()
            await asyncio.sleep(delay)
            if self._stopping:
                return
            await self._spawn(number)

    async def run(self) -> int:
        args, cfg = self._args, self._config
        host, _, port = (args.listen or cfg.listen.http).rpartition(":")
        try:
            reserved = reserve_port(host, int(port))
        except OSError as exc:
            raise UserInputError(f"cannot listen: http {host}:{port}: {exc.strerror or exc}") from None
        http_port = int(reserved.getsockname()[1])
        self._listen = f"{host}:{http_port}"
        link = ParentLink(str(self._dir / "hub.sock"), self._worker_listening)
        app = GatewayApp(cfg, config_path=args.config, link=link)
        self._live = Gauge("kvgate_workers", "HTTP worker processes listening", registry=app.registry)
        restarts = Counter(
            "kvgate_worker_restarts", "Worker processes started again after exiting", registry=app.registry
        )
        freeze_startup_heap()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, app.reload)
        tasks: list[asyncio.Task[None]] = []
        try:
            try:
                await app.start(inventory=args.inventory)
            except OSError as exc:
                raise UserInputError(f"cannot listen: {exc.strerror or exc}") from None
            create_table(self._dir / LOAD_TABLE, self._count)
            self._load_table = SharedLoad(self._dir / LOAD_TABLE, None)
            for number in range(self._count):
                await self._spawn(number)
            await self._wait_ready(stop)
            inv_host = (args.inventory or cfg.listen.inventory).rpartition(":")[0]
            print(
                f"kvgate serve: http={host}:{http_port} inventory={inv_host}:{app.inventory_port}", flush=True
            )
            tasks = [
                loop.create_task(self._supervise(n, restarts), name=f"kvgate-worker-{n}")
                for n in range(self._count)
            ]
            await stop.wait()
        finally:
            self._stopping = True
            for task in tasks:
                await cancel_and_wait(task)
            await self._stop_workers()
            self._listening.clear()
            self._count_listening()
            await app.stop()
            reserved.close()
            if self._load_table is not None:
                self._load_table.close()
            shutil.rmtree(self._dir, ignore_errors=True)
        return 0

    def _worker_listening(self, number: int) -> None:
        self._listening.add(number)
        self._count_listening()

    def _count_listening(self) -> None:
        if self._live is not None:
            self._live.set(len(self._listening))
        self._changed.set()

    async def _wait_ready(self, stop: asyncio.Event) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not stop.is_set():
            pending = set(range(self._count)) - self._listening
            if not pending:
                return
            dead = [n for n in sorted(pending) if self._procs[n].returncode is not None]
            if dead:
                raise UserInputError(f"worker {dead[0]} exited while starting (see its log above)")
            if time.monotonic() > deadline:
                raise UserInputError(f"workers {sorted(pending)} not listening after {START_TIMEOUT_S:.0f}s")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 0.2)

    async def _stop_workers(self) -> None:
        """SIGTERM to every worker (each drains), then SIGKILL to those still there after the
        drain, the grace and ``STOP_SLACK_S``."""
        server = self._config.server
        procs = [p for p in self._procs.values() if p.returncode is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        budget = server.drain_delay_s + server.shutdown_grace_s + STOP_SLACK_S
        waits = [asyncio.ensure_future(p.wait()) for p in procs]
        if waits:
            _, late = await asyncio.wait(waits, timeout=budget)
            for proc in procs:
                if proc.returncode is None:
                    log.error("worker pid %d still running %.0fs after SIGTERM: killed", proc.pid, budget)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            for w in late:
                await w


async def serve_workers(args: argparse.Namespace, config: GatewayConfig, count: int) -> int:
    return await Supervisor(args, config, count).run()
