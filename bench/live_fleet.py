"""The live bench's fleet (bench/live.py, bench/live_floor.py): ``kvgate sim-engine``s started
with a workload's speeds and cache size, ready when each has printed its endpoints, and the one
streamed completion both benches send to it and time."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import aiohttp

from bench.live_kvgate import MODEL
from bench.live_workloads import TOKENIZER, LiveWorkload
from kvgate_tools.procs import ProcessGroup, Ready


def request_log_path(folder: Path, engine: int) -> Path:
    """Where engine ``engine`` of a fleet started with ``request_logs=folder`` logs its requests."""
    return folder / f"engine{engine}_requests.jsonl"


def start_fleet(
    procs: ProcessGroup,
    n: int,
    args: argparse.Namespace,
    w: LiveWorkload | None = None,
    cache_blocks: int | None = None,
    request_logs: Path | None = None,
) -> list[tuple[str, str, str]]:
    """(http url, events endpoint, replay endpoint) per engine (``w``: its speeds; the KV blocks
    per engine are ``cache_blocks``, else ``--cache-blocks``; ``request_logs``: a folder where
    each engine logs its requests' arrivals, ``request_log_path``; bench/live_hop.py)."""
    procs_ = []
    slowdowns = w.slowdowns if w is not None else (1.0,)
    cache_blocks = cache_blocks or args.cache_blocks
    for i in range(n):
        procs_.append(
            procs.spawn(
                f"engine{i}",
                [
                    sys.executable,
                    "-m",
                    "gateway.cli",
                    "sim-engine",
                    "--port",
                    "0",
                    "--events-port",
                    "0",
                    # the agent replays what it missed before its subscription took (a slow
                    # joiner otherwise starts degraded: its index lacks the first batches' blocks)
                    "--replay-port",
                    "0",
                    "--model",
                    MODEL,
                    "--tokenizer",
                    str(TOKENIZER),
                    "--time-scale",
                    str(args.time_scale * slowdowns[i % len(slowdowns)]),
                    "--cache-blocks",
                    str(cache_blocks),
                    "--seed",
                    str(i),
                    "--block-size",
                    "16",
                    *(
                        ["--request-log", str(request_log_path(request_logs, i))]
                        if request_logs is not None
                        else []
                    ),
                ],
            )
        )
    fleet = []
    for i, proc in enumerate(procs_):
        m = procs.wait_ready(
            f"engine{i}", proc, Ready(pattern=r"sim-engine ready http=(\S+) events=(\S+) replay=(\S+)")
        )
        assert m is not None
        fleet.append((m.group(1), m.group(2), m.group(3)))
    return fleet


async def stream_completion(
    http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> tuple[int, float, float]:
    """One streamed completion of ``prompt``: (HTTP status, seconds to the first SSE data, seconds
    to the end); the usage chunk is asked for (kvgate audits its cached-token prediction)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    ttft = 0.0
    async with http.post(url + "/v1/completions", json=body) as resp:
        async for chunk in resp.content.iter_any():
            if not ttft and b"data:" in chunk:
                ttft = time.perf_counter() - t0
        return resp.status, ttft, time.perf_counter() - t0
