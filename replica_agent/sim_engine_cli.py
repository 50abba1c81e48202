"""``kvgate sim-engine``: a simulated vLLM engine (HTTP API + ZMQ KV events) for demos and tests."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from router_policies.errors import UserInputError
from router_policies.flags import options_from_flags


def configure(parser: argparse.ArgumentParser) -> None:
    from replica_agent.sim_engine.options import default_tokenizer_dir
    from router_policies.sim.profiles import DEFAULT_PROFILE, PROFILES

    parser.description = (
        "Serve vLLM's OpenAI-compatible HTTP API in front of the simulator's replica model, running in "
        "real time, and publish vLLM-format KV-cache events on ZMQ (PUB + replay ROUTER)."
    )
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address for HTTP and ZMQ sockets (default 127.0.0.1)")
    a("--port", type=int, required=True, help="HTTP port (0: any free port, named in the ready line)")
    a("--events-port", type=int, required=True, help="ZMQ PUB port for KV events (0: any free port)")
    a("--replay-port", type=int, default=None, help="ZMQ ROUTER port for replay (default: no replay socket)")
    a("--model", default="kvgate-sim", help="served model name (default kvgate-sim)")
    a(
        "--tokenizer",
        type=Path,
        default=default_tokenizer_dir(),
        help="tokenizer directory (tokenizer.json + tokenizer_config.json)",
    )
    a("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    a(
        "--cache-blocks",
        type=int,
        default=None,
        help="KV cache capacity in blocks (default: the profile's budget)",
    )
    a(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"cost profile: {', '.join(sorted(PROFILES))} (default {DEFAULT_PROFILE})",
    )
    a(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply every step cost (0.01 runs 100x faster; default 1)",
    )
    a("--seed", type=int, default=0, help="seed of the generated tokens and response ids (default 0)")
    a(
        "--hash-format",
        choices=["int", "bytes"],
        default="int",
        help="block hashes as unsigned 64-bit ints (vLLM's default) or 32-byte digests",
    )
    a(
        "--event-encoding",
        choices=["map", "array"],
        default="map",
        help="events as maps with a 'type' key (current vLLM) or tagged arrays (older vLLM)",
    )
    a("--topic", default="", help="ZMQ topic frame (vLLM's default is empty)")
    a(
        "--replay-buffer",
        type=int,
        default=10_000,
        help="event batches kept for replay (default 10000, as vLLM)",
    )
    a(
        "--max-pending",
        type=int,
        default=1024,
        help="requests in the engine (running + waiting) before 503 (default 1024)",
    )
    a("--max-model-len", type=int, default=8192, help="prompt + output tokens per request (default 8192)")
    a("--default-max-tokens", type=int, default=16, help="max_tokens when a request gives none (default 16)")
    a("--max-num-seqs", type=int, default=None, help="running requests per step (default: the profile's)")
    a("--max-num-batched-tokens", type=int, default=None, help="tokens per step (default: the profile's)")
    a(
        "--request-log",
        type=Path,
        default=None,
        help="write each generation request's arrival and parse time here, one JSON line a request "
        "(the live bench's inbound hop; default: none)",
    )


def run(args: argparse.Namespace) -> int:
    # transformers announces at import that PyTorch is absent; we only use its tokenizers.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import uvloop
    import zmq

    from replica_agent.sim_engine.engine_hashes import HashFormat
    from replica_agent.sim_engine.kv_events import EventEncoding
    from replica_agent.sim_engine.options import EngineOptions
    from replica_agent.sim_engine.server import serve

    # every option is the flag of its name
    opts = options_from_flags(
        EngineOptions,
        args,
        hash_format=HashFormat(args.hash_format),
        event_encoding=EventEncoding(args.event_encoding),
    )
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(serve(opts))
    except zmq.ZMQError as exc:
        raise UserInputError(f"cannot bind the KV-event sockets: {exc}") from None
    except OSError as exc:
        raise UserInputError(f"cannot bind --host {args.host} --port {args.port}: {exc}") from None
