"""The TTFT floor of a live workload: what no router can beat (bench/live.py, docs/performance.md
"The floor under the live tail").

Each request of the workload is sent alone, in order, to one idle ``kvgate sim-engine`` of the
fleet's fastest kind whose cache holds the whole working set, directly (no router), with one
output token. So every request finds every earlier prompt's blocks cached, no queue ahead, no
decode beside it and no hop: its TTFT there (``floor_i``) is its own prefill of what no earlier
request shared, the least it can take on this fleet whatever the placement.

Why it bounds a router's quantiles: in the routed run request i's TTFT is at least floor_i (its
uncached tokens are at least as many, its engine at most as fast and at least as busy), and a
quantile is monotone in every sample, so a router's p99 is at least the floor's p99. Two caveats:
each side is one measurement (timing noise of a fraction of a millisecond), and a request that
in a routed run reuses the blocks of one sent after it (same-millisecond arrivals, the later one
prefilled first) could beat its floor. Where the
floor's p99 exceeds a target for a router's p99 (0.8x the best peer's, issue 11), no placement
meets it on that workload; the distance between a router's p99 and the floor's is what placement
can still win.

The fleet-LRU floor (``--lru-floor``) is the same replay on an engine whose cache is the whole
fleet's KV (replicas x blocks per engine) under the engine's own LRU eviction: what a router
gets that never queues a request and uses the fleet's caches as well as one shared LRU would.
It is a reference, not a bound (placement over separate caches can keep what one LRU drops, as
a set-associative cache can beat a fully associative one on some sequences): a router near it
at p99 has its slowest first tokens in prompts whose blocks that LRU had evicted too, prefilled
alone.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import aiohttp
import uvloop

from bench.live_fleet import start_fleet, stream_completion
from bench.live_workloads import LiveWorkload, working_set_blocks
from kvgate_tools.procs import ProcessGroup


async def sequential_ttfts(url: str, prompts: list[str], timeout_s: float) -> list[float]:
    """Each prompt streamed with one output token, the next sent once the previous has ended;
    the client TTFT of each, in seconds (a failed request raises: a floor with holes is none)."""
    out: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        for prompt in prompts:
            status, ttft, _total = await stream_completion(http, url, prompt, 1)
            if status != 200 or ttft <= 0:
                raise RuntimeError(f"floor: the engine answered {status} without a first token")
            out.append(ttft)
    return out


def floor_fleet(w: LiveWorkload, reqs: list[tuple[float, str, int]]) -> tuple[LiveWorkload, int]:
    """The floor's engine: ``w`` at its fastest engines' speed, and KV blocks for the whole
    working set and room for the largest requests besides (nothing is ever evicted)."""
    working_set, largest = working_set_blocks(reqs)
    return replace(w, slowdowns=(min(w.slowdowns),)), working_set + 4 * largest


def floor_run(
    w: LiveWorkload,
    reqs: list[tuple[float, str, int]],
    args: argparse.Namespace,
    tmp: Path,
    fleet_blocks: int | None = None,
) -> list[float]:
    """Each request's floor TTFT in ms, ``reqs`` on ``w``'s fleet (docstring); bench/live_pool.py
    takes the quantiles (over one seed's requests or several). ``fleet_blocks``: the fleet-LRU
    floor's cache (the fleet's KV blocks in all), else one that never evicts."""
    fastest, cache_blocks = floor_fleet(w, reqs)
    if fleet_blocks is not None:
        cache_blocks = fleet_blocks
    with ProcessGroup(tmp) as procs:
        ((url, _events, _replay),) = start_fleet(procs, 1, args, fastest, cache_blocks)
        ttfts = uvloop.run(sequential_ttfts(url, [p for _t, p, _n in reqs], args.timeout))
    return [t * 1e3 for t in ttfts]
