"""``kvgate serve --config FILE [--listen HOST:PORT] [--inventory HOST:PORT] [--workers N]``: run
the gateway on uvloop until SIGTERM or SIGINT; SIGHUP reloads the config file.

With ``--workers N`` (``server.workers``; default: the cores the process may use) above 1, the
process is the parent of N HTTP workers on the one port (gateway/workers.py; docs/architecture.md,
"Workers"); 1 runs the whole gateway in this process. A worker is this command with the hidden
``--worker-of SOCKET --worker-index I``.

Once listening it prints one line on stdout, ``kvgate serve: http=HOST:PORT inventory=HOST:PORT``
with the bound ports (so port 0 can be used), and flushes it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

import uvloop

from gateway.app import GatewayApp
from gateway.config import GatewayConfig, load_config
from gateway.local_hub_client import HubClient
from gateway.workers import serve_workers, worker_count
from gateway.workers_ttft import warm_up
from router_policies.errors import UserInputError
from router_policies.gc_settings import freeze_startup_heap


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="gateway YAML config (see docs/gateway.md)")
    parser.add_argument("--listen", default=None, help="HOST:PORT of the HTTP API (overrides listen.http)")
    parser.add_argument(
        "--inventory", default=None, help="HOST:PORT of the agents' gRPC stream (overrides listen.inventory)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="HTTP worker processes on the one port (overrides server.workers; default: the cores "
        "this process may use; 1: one process)",
    )
    parser.add_argument("--worker-of", default=None, help=argparse.SUPPRESS)  # the parent's socket
    parser.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker-count", type=int, default=1, help=argparse.SUPPRESS)  # its parent's workers


async def _serve(args: argparse.Namespace, config: GatewayConfig | None = None) -> int:
    """Serve as one process, or as a worker of ``--worker-of`` (``config``: already loaded)."""
    config = config if config is not None else load_config(args.config)
    link = HubClient(args.worker_of, args.worker_index, args.worker_count) if args.worker_of else None
    app = GatewayApp(config, config_path=args.config, link=link)
    if link is None:  # one process fits its own TTFT model (the parent of workers fits theirs)
        warm_up()  # the first fit's one-time kernel load: before the freeze, not on a request
    freeze_startup_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if link is None:
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGHUP, app.reload)
    else:  # the parent relays both (a terminal's ^C reaches the whole process group)
        loop.add_signal_handler(signal.SIGINT, lambda: None)
        loop.add_signal_handler(signal.SIGHUP, lambda: None)
    try:
        try:
            await app.start(http=args.listen, inventory=args.inventory)
        except OSError as exc:
            raise UserInputError(f"cannot listen: {exc.strerror or exc}") from None
        if link is not None:
            link.listening()
            await _first(stop.wait(), link.lost.wait())
            return 0
        http_host = (args.listen or config.listen.http).rpartition(":")[0]
        inv_host = (args.inventory or config.listen.inventory).rpartition(":")[0]
        print(
            f"kvgate serve: http={http_host}:{app.http_port} inventory={inv_host}:{app.inventory_port}",
            flush=True,
        )
        await stop.wait()
    finally:
        await app.stop()
    return 0


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Return once the first of ``waits`` is done (the others cancelled)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def run(args: argparse.Namespace) -> int:
    # Every encode runs on the thread that asked for it (the event loop, the request-path pool or
    # the lowest-priority deferred thread), which releases the GIL meanwhile. Left on, tokenizers
    # would run them on its own thread pool, spawned by whichever thread encodes first and
    # inheriting that thread's priority, so request-path encodes could run at the deferred
    # thread's priority. An explicit setting by the operator wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.listen is not None:
        _check_host_port("--listen", args.listen)
    if args.inventory is not None:
        _check_host_port("--inventory", args.inventory)
    if args.worker_of is None:
        config = load_config(args.config)
        count = worker_count(args.workers, config)
        if count > 1:
            return uvloop.run(serve_workers(args, config, count))
        return uvloop.run(_serve(args, config))  # loaded once
    return uvloop.run(_serve(args))


def _check_host_port(flag: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserInputError(f"{flag}: expected HOST:PORT, got {value!r}")


if __name__ == "__main__":
    from gateway.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
