"""``kvgate agent``: run a replica agent beside an engine (vLLM, SGLang or ``kvgate sim-engine``).

    kvgate agent --replica-id r0 --engine-url http://127.0.0.1:8001 \\
        --events tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --gateway 127.0.0.1:50051

Runs until SIGTERM or SIGINT, then closes its gateway stream and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import fields

import uvloop

from replica_agent.agent import Agent, AgentConfig
from router_policies.errors import UserInputError
from router_policies.gc_settings import freeze_startup_heap


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica-id", required=True, help="replica id, as the gateway knows it")
    parser.add_argument("--engine-url", required=True, help="engine base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--events", required=True, help="engine KV-event PUB endpoint, e.g. tcp://127.0.0.1:5557"
    )
    parser.add_argument(
        "--replay", default=None, help="engine replay ROUTER endpoint, e.g. tcp://127.0.0.1:5558"
    )
    parser.add_argument("--gateway", required=True, help="gateway inventory HOST:PORT")
    parser.add_argument(
        "--token-env",
        default="KVGATE_AGENT_TOKEN",
        help="environment variable holding the gateway's agent token (default %(default)s; unset: none)",
    )
    parser.add_argument("--tls-ca", default=None, help="PEM CA bundle: connect to the gateway over TLS")
    parser.add_argument(
        "--model", default=None, help="model name rooting block keys (default: engine's first)"
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="engine block size (default: from the engine)"
    )
    parser.add_argument("--capacity-blocks", type=int, default=None, help="engine KV capacity in blocks")
    parser.add_argument(
        "--key-block-size",
        type=int,
        default=None,
        help="tokens per key block when the gateway's block_size is a multiple of the engine's "
        "(default: the engine's block size)",
    )
    parser.add_argument(
        "--advertise-url", default=None, help="URL the gateway should route to (default --engine-url)"
    )
    parser.add_argument("--topic", default="", help="ZMQ topic to subscribe to (default: all)")
    parser.add_argument("--max-blocks", type=int, default=2_000_000, help="bound of the engine-hash map")
    parser.add_argument("--load-interval", type=float, default=1.0, help="seconds between /metrics polls")
    parser.add_argument(
        "--models-interval",
        type=float,
        default=1.0,
        help="seconds between /v1/models polls for the engine's loaded LoRA adapters (0: never)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the reconnect jitter")
    parser.add_argument(
        "--reconnect-max", type=float, default=1.0, help="longest wait between gateway reconnects, seconds"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the agent's Prometheus /metrics here (0: any port)",
    )
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address of --metrics-port")
    parser.add_argument(
        "--nice",
        type=int,
        default=10,
        help="CPU niceness added to the agent's own at start (0-19, default %(default)s): no request "
        "waits for the agent, so the engine's and the gateway's processes get the CPU first",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def _check(args: argparse.Namespace) -> AgentConfig:
    for flag, value in (("--events", args.events), ("--replay", args.replay)):
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise UserInputError(f"{flag}: expected a ZMQ endpoint like tcp://HOST:PORT, got {value!r}")
    host, sep, port = args.gateway.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserInputError(f"--gateway: expected HOST:PORT, got {args.gateway!r}")
    if not args.engine_url.startswith(("http://", "https://")):
        raise UserInputError(f"--engine-url: expected http(s)://..., got {args.engine_url!r}")
    for flag, value in (
        ("--block-size", args.block_size),
        ("--capacity-blocks", args.capacity_blocks),
        ("--key-block-size", args.key_block_size),
    ):
        if value is not None and value <= 0:
            raise UserInputError(f"{flag}: must be positive, got {value}")
    if args.key_block_size and args.block_size and args.key_block_size % args.block_size:
        raise UserInputError(
            f"--key-block-size: {args.key_block_size} is not a multiple of --block-size {args.block_size}"
        )
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise UserInputError(f"--metrics-port: not a port: {args.metrics_port}")
    if args.max_blocks <= 0:
        raise UserInputError("--max-blocks: must be positive")
    if args.reconnect_max <= 0:
        raise UserInputError("--reconnect-max: must be positive")
    if args.load_interval <= 0:
        raise UserInputError("--load-interval: must be positive")
    if args.models_interval < 0:
        raise UserInputError("--models-interval: must not be negative")
    if not 0 <= args.nice <= 19:
        raise UserInputError(f"--nice: must be in [0, 19], got {args.nice}")
    tls_ca = None
    if args.tls_ca:
        try:
            with open(args.tls_ca, "rb") as f:
                tls_ca = f.read()
        except OSError as exc:
            raise UserInputError(f"--tls-ca: cannot read {args.tls_ca}: {exc.strerror}") from None
    # the flags named as AgentConfig fields set them as they are; the rest are translated here
    flags = {f.name: getattr(args, f.name) for f in fields(AgentConfig) if hasattr(args, f.name)}
    flags["token"] = os.environ.get(args.token_env) or None if args.token_env else None
    flags["tls_ca"] = tls_ca  # the PEM bytes, where the flag holds their path
    flags["load_interval_s"] = args.load_interval
    flags["models_interval_s"] = args.models_interval
    flags["backoff_max_s"] = args.reconnect_max
    return AgentConfig(**flags)


async def _main(cfg: AgentConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await Agent(cfg).run(stop)


def lower_priority(increment: int) -> None:
    """Add ``increment`` to this process's niceness. The agent shares its host with the engine
    (vLLM's scheduler and API server are Python processes on the CPU) and often with the gateway:
    a KV event applied a few milliseconds later costs no request anything, a busy core taken from
    them delays first tokens. Not permitted or not supported: the agent runs as it is."""
    if increment > 0:
        with contextlib.suppress(OSError, AttributeError):
            os.nice(increment)


def run(args: argparse.Namespace) -> int:
    cfg = _check(args)
    lower_priority(args.nice)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the gateway's collector settings and uvloop: on the RAG trace's replay the collector was
    # ~15 % of an agent's perf samples, and uvloop took 12-16 % off its CPU per request against
    # asyncio's own loop (docs/performance.md, "The agent on uvloop, and its collector")
    freeze_startup_heap()
    uvloop.run(_main(cfg))
    return 0
