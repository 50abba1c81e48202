"""The live bench's fleet (bench/live.py, bench/live_floor.py): ``kvgate sim-engine``s started
with a workload's speeds and cache size, ready when each has printed its endpoints."""

from __future__ import annotations

import argparse
import sys

from bench.live_kvgate import MODEL
from bench.live_workloads import TOKENIZER, LiveWorkload
from kvgate_tools.procs import ProcessGroup, Ready


def start_fleet(
    procs: ProcessGroup, n: int, args: argparse.Namespace, w: LiveWorkload | None = None
) -> list[tuple[str, str, str]]:
    """(http url, events endpoint, replay endpoint) per engine (``w``: its speeds and cache size)."""
    procs_ = []
    slowdowns = w.slowdowns if w is not None else (1.0,)
    cache_blocks = getattr(args, "run_cache_blocks", None) or args.cache_blocks
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
