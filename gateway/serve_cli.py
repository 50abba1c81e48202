"""``kvgate serve --config FILE [--listen HOST:PORT] [--inventory HOST:PORT]``: run the gateway on
uvloop until SIGTERM or SIGINT; SIGHUP reloads the config file.

Once listening it prints one line on stdout, ``kvgate serve: http=HOST:PORT inventory=HOST:PORT``
with the bound ports (so port 0 can be used), and flushes it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import sys

import uvloop

from gateway.app import GatewayApp
from gateway.config import load_config
from router_policies.errors import UserInputError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="gateway YAML config (see docs/gateway.md)")
    parser.add_argument("--listen", default=None, help="HOST:PORT of the HTTP API (overrides listen.http)")
    parser.add_argument(
        "--inventory", default=None, help="HOST:PORT of the agents' gRPC stream (overrides listen.inventory)"
    )


async def _serve(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    app = GatewayApp(config, config_path=args.config)
    # What exists now (modules, tokenizers, templates, config, the app) lives as long as the
    # process. Left tracked, every full collection walks all of it (~165k objects: 80-120 ms of a
    # stalled event loop on a loaded 2-core host, measured on the live benchmark); frozen, full
    # collections walk only what requests create. Done before start, while nothing is running.
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, app.reload)
    try:
        try:
            await app.start(http=args.listen, inventory=args.inventory)
        except OSError as exc:
            raise UserInputError(f"cannot listen: {exc.strerror or exc}") from None
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
    return uvloop.run(_serve(args))


def _check_host_port(flag: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserInputError(f"{flag}: expected HOST:PORT, got {value!r}")


if __name__ == "__main__":
    from gateway.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
