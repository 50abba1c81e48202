"""Routing quality on a live fleet: the same replayed workload through each router, each in front
of a fresh fleet of simulated engines (``kvgate sim-engine``: vLLM's HTTP API, its /metrics and
its KV events, over the simulator's replica model in real time).

Workloads (``bench/live_workloads.py``): ``agent``, ``mooncake``, any Mooncake-format trace with
``--trace FILE`` (alone, it is the only workload), and three where placement matters most:
``kv_pressure`` (the fleet's KV cache half the working set), ``hetero`` (every other engine 3x
slower) and ``decode_heavy`` (256-token outputs). Prompts are capped at ``--max-blocks`` blocks
and outputs at ``--max-tokens``; arrival times are divided by ``--speedup`` and engine step costs
multiplied by ``--time-scale`` (the same ratio keeps the load of the original trace).

Routers: kvgate kv_aware (with one ``kvgate agent`` per engine streaming its KV events), and from
the peers' virtualenv (``.venv-bench``, or ``$KVGATE_BENCH_VENV``): sglang-router cache_aware,
vllm-router kv_aware (fed the engines' ZMQ KV events directly; falls back to cache_aware if it
will not start). One row per (workload, router): engine-counted prefix hit rate (sum of
``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` over the fleet), client
TTFT p50/p99 of streamed completions, engine TTFT p50/p99 (the engines' own
``vllm:time_to_first_token_seconds`` histograms, summed over the fleet: placement apart from the
hop), the stages of each first token (per request, ``bench/live_hop.py``): the hop in (client send
to engine handler), the engines' parse, the engine to its first token written, and the hop out
(that token to the client's first read), p50/p99 each, the router's CPU milliseconds per
request during the replay (its process tree; kvgate's agents apart, ``router_cpu_s``),
completed requests per second, errors; for kvgate also its audits (``live_metrics``): the TTFT
model's median absolute error and the cached-token audit's exact share and causes. Each seed of
``--seeds`` (default three) is another slice of the workload replayed through every router; a
row pools a router's replays (``bench/live_pool.py``) and keeps each seed's figures under
``per_seed``. Each replay leaves its processes' logs and one record a request (``requests.jsonl``,
``bench/live_requests.py`` compares two routers' request by request) in
``<out's folder>/tmp/live/<workload>-<router>-<seed>``.

    .venv/bin/python -m bench.live [--requests 300] [--replicas 4] [--seeds 5 6 7] [--trace FILE] [--out bench/results/live.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from bench import live_metrics
from bench.cpu_time import trees_cpu_s
from bench.live_fleet import request_log_path, start_fleet, stream_completion
from bench.live_floor import floor_run
from bench.live_hop import REQUESTS_FILE, Sent, read_logs, request_records, send_key, stages, write_requests
from bench.live_kvgate import MODEL, merged, start_agents, start_kvgate, wait_agents
from bench.live_pool import RunMeasure, pooled_floor, pooled_row
from bench.live_workloads import (
    MOONCAKE,
    TOKENIZER,
    LiveWorkload,
    load,
    pressure_cache_blocks,
    render,
    workload,
)
from bench.results_file import write_results
from kvgate_tools.procs import ProcessGroup, Ready, free_port

ROOT = Path(__file__).resolve().parent.parent
BENCH_VENV = Path(os.environ.get("KVGATE_BENCH_VENV", ROOT / ".venv-bench"))
# kvgate's router names: kv_aware as configured (``--kvgate-params``), or with its rule set, so
# that both rules can be compared in one run (``--routers kvgate_kv_aware_ms kvgate_kv_aware_tokens ...``)
KVGATE_RULES = {"kvgate_kv_aware": None, "kvgate_kv_aware_ms": "ms", "kvgate_kv_aware_tokens": "tokens"}


async def replay(
    url: str, reqs: list[tuple[float, str, int]], speedup: float, timeout_s: float
) -> tuple[list[tuple[int, float, float]], list[Sent], float]:
    """Open-loop replay; returns per request (status, ttft s, total s), per request in the order
    of ``reqs`` its send time on the host's monotonic clock, its prompt's key and when its first
    data was read (``live_hop``), and the wall time."""
    results: list[tuple[int, float, float]] = []
    sends: list[Sent] = [(0.0, 0, None)] * len(reqs)  # each set by its request
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:

        async def one(i: int, at: float, prompt: str, max_tokens: int) -> None:
            await asyncio.sleep(max(0.0, at / speedup - (time.perf_counter() - start)))
            # the send on the clock the engines log on; its first data read that long after
            # (``stream_completion`` starts its own clock microseconds later)
            key = send_key(prompt)
            sent = time.monotonic()
            t0 = time.perf_counter()
            try:
                status, ttft, total = await stream_completion(http, url, prompt, max_tokens)
            except (TimeoutError, aiohttp.ClientError):
                status, ttft, total = 0, 0.0, time.perf_counter() - t0
            results.append((status, ttft, total))
            sends[i] = (sent, key, sent + ttft if ttft > 0 else None)

        start = time.perf_counter()
        await asyncio.gather(*(one(i, *r) for i, r in enumerate(reqs)))
        return results, sends, time.perf_counter() - start


_HITS, _QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def engine_state(http_urls: list[str]) -> tuple[float, float, dict[float, float], list[float]]:
    """The fleet's prefix-cache hits and queries (tokens) and TTFT histogram, summed, and each
    engine's queries (where the router sent the prompt tokens)."""
    texts = [live_metrics.scrape(u) for u in http_urls]
    got = live_metrics.sums(texts, (_HITS, _QUERIES))
    each = [live_metrics.sums([t], (_QUERIES,))[_QUERIES] for t in texts]
    return got[_HITS], got[_QUERIES], live_metrics.buckets(texts), each


def start_router(
    procs: ProcessGroup,
    name: str,
    fleet: list[tuple[str, str, str]],
    tmp: Path,
    kvgate_params: dict[str, Any] | None = None,
    kvgate_config: dict[str, Any] | None = None,
) -> tuple[str, str]:
    """Start router ``name`` in front of ``fleet``; returns (base url, policy actually used).
    ``kvgate_params``: kv_aware's parameters in kvgate's config; ``kvgate_config``: its other
    settings (``server.workers`` 1 unless given: the audit and TTFT figures are read from one
    process)."""
    urls = [u for u, *_ in fleet]
    if name in KVGATE_RULES:
        params = dict(kvgate_params or {})
        if KVGATE_RULES[name]:  # a variant naming kv_aware's rule (compared in the same run)
            params["rule"] = KVGATE_RULES[name]
        http, inventory = start_kvgate(procs, urls, tmp, params, kvgate_config or {})
        start_agents(procs, fleet, inventory)
        wait_agents(http, len(fleet))
        return "http://" + http, "kv_aware"
    port = free_port()
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    if name == "sglang_cache_aware":
        procs.start(
            name,
            [
                str(BENCH_VENV / "bin/python"), "-m", "sglang_router.launch_router", "--worker-urls", *urls,
                "--policy", "cache_aware", *common, "--log-level", "warn", "--model-path", str(TOKENIZER),
            ],
            Ready(url=f"http://127.0.0.1:{port}/v1/models"),
            extra_env={"HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        return f"http://127.0.0.1:{port}", "cache_aware"
    if name == "vllm_router_best":
        sources = [arg for u, ev, _ in fleet for arg in ("--kv-event-source", f"{u}={ev}")]
        try:
            procs.start(
                name,
                [
                    str(BENCH_VENV / "bin/vllm-router"), "--worker-urls", *urls, "--policy", "kv_aware",
                    *sources, "--kv-event-block-size", "16", "--kv-event-model", MODEL,
                    *common, "--log-level", "warning",
                ],
                Ready(url=f"http://127.0.0.1:{port}/v1/models", timeout_s=30),
                extra_env={"HF_HUB_OFFLINE": "1"},
            )  # fmt: skip
            return f"http://127.0.0.1:{port}", "kv_aware"
        except RuntimeError as exc:
            print(
                f"live: vllm-router kv_aware did not start ({str(exc)[:300]}); using cache_aware",
                file=sys.stderr,
            )
            port = free_port()
            common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
            procs.start(
                name + "_ca",
                [
                    str(BENCH_VENV / "bin/vllm-router"), "--worker-urls", *urls, "--policy", "cache_aware",
                    *common, "--log-level", "warning",
                ],
                Ready(url=f"http://127.0.0.1:{port}/v1/models"),
                extra_env={"HF_HUB_OFFLINE": "1"},
            )  # fmt: skip
            return f"http://127.0.0.1:{port}", "cache_aware"
    raise ValueError(f"unknown router {name!r}")


@dataclass(frozen=True, slots=True)
class SeedRun:
    """One seed's slice of a workload: its requests, and the engines' KV blocks for it
    (``kv_pressure``'s share of its working set; None: ``--cache-blocks``)."""

    seed: int
    reqs: list[tuple[float, str, int]]
    cache_blocks: int | None = None
    working_set: int | None = None

    @staticmethod
    def of(w: LiveWorkload, seed: int, args: argparse.Namespace) -> SeedRun:
        reqs = render(load(w, args.requests, seed), w, args.requests, args.max_blocks, args.max_tokens)
        # KV pressure: the fleet's caches together hold 1 / pressure of the working set
        pressure = pressure_cache_blocks(reqs, w, args.replicas)
        return SeedRun(seed, reqs, *pressure) if pressure else SeedRun(seed, reqs)


def one_run(w: LiveWorkload, router: str, run: SeedRun, args: argparse.Namespace) -> RunMeasure:
    tmp = args.out.parent / "tmp" / "live" / f"{w.name.replace(':', '_')}-{router}-{run.seed}"
    audit: dict[str, Any] = {}
    with ProcessGroup(tmp) as procs:
        fleet = start_fleet(procs, args.replicas, args, w, run.cache_blocks, request_logs=tmp)
        ours = len(procs.started)
        url, policy = start_router(procs, router, fleet, tmp, args.kvgate_params, args.kvgate_config)
        urls = [u for u, *_ in fleet]
        h0, q0, b0, e0 = engine_state(urls)
        cpu0 = router_cpu_s(procs.started[ours:])
        results, sends, wall = uvloop.run(replay(url, run.reqs, args.speedup, args.timeout))
        cpu1 = router_cpu_s(procs.started[ours:])
        h1, q1, b1, e1 = engine_state(urls)
        records = request_records(sends, read_logs([request_log_path(tmp, i) for i in range(len(fleet))]))
        write_requests(tmp / REQUESTS_FILE, records)
        hops = stages(records)
        if router.startswith("kvgate"):
            audit = dict(live_metrics.kvgate_audit(live_metrics.scrape(url)))
            # the fleet as kvgate saw it (fitted TTFT models)
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(url + "/admin/replicas", timeout=5) as r,
            ):
                (tmp / "kvgate_replicas.json").write_bytes(r.read())
    return RunMeasure(
        seed=run.seed,
        policy=policy,
        statuses=[s for s, _t, _tot in results],
        ttft_ms=[t * 1e3 for s, t, _tot in results if s == 200 and t > 0],
        wall_s=wall,
        hits=h1 - h0,
        queries=q1 - q0,
        engine_queries=[a - b for a, b in zip(e1, e0, strict=True)],
        engine_ttft=live_metrics.delta(b1, b0),
        audit=audit,
        stages=hops,
        router_cpu_s=cpu1[0] - cpu0[0],
        agents_cpu_s=cpu1[1] - cpu0[1],
    )


def router_cpu_s(started: list[tuple[str, subprocess.Popen[bytes]]]) -> tuple[float, float]:
    """CPU seconds so far of the router's processes (with their children: kvgate's workers) and
    of its agents (kvgate's, named ``agent<i>`` by ``start_agents``), from ``started``: what
    ``start_router`` started. A process that has exited counts 0 (vllm-router's failed start)."""
    cpu = trees_cpu_s([p.pid for _name, p in started])
    agents = sum(c for (name, _p), c in zip(started, cpu, strict=True) if name.startswith("agent"))
    return sum(cpu) - agents, agents


def workload_rows(wl: str, routers: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per router for workload ``wl``: every seed's replay through it, pooled
    (bench/live_pool.py); the floor likewise, over the same seeds."""
    w = workload(wl, args.trace or MOONCAKE)
    runs: dict[str, list[RunMeasure]] = {r: [] for r in routers}
    floors: list[list[float]] = []
    lru_floors: list[list[float]] = []
    slices = [SeedRun.of(w, seed, args) for seed in args.seeds]
    for run in slices:
        tmp = args.out.parent / "tmp" / "live" / f"{w.name.replace(':', '_')}-floor-{run.seed}"
        if not args.no_floor:
            floors.append(floor_run(w, run.reqs, args, tmp))
        if args.lru_floor:
            fleet_blocks = args.replicas * (run.cache_blocks or args.cache_blocks)
            lru_floors.append(floor_run(w, run.reqs, args, tmp.with_name(tmp.name + "-lru"), fleet_blocks))
        for router in routers:
            runs[router].append(one_run(w, router, run, args))
            _print_row(w.name, router, run.seed, pooled_row(runs[router][-1:]))
    floor = pooled_floor(floors) if floors else {}
    if lru_floors:
        floor |= {f"lru_{k}": v for k, v in pooled_floor(lru_floors).items()}
    for prefix, what in (("", "all cached before"), ("lru_", "the fleet's KV as one LRU")):
        if f"{prefix}floor_ttft_p99_ms" in floor:
            print(
                f"{w.name:12} {prefix + 'floor':20} ttft p50 {floor[f'{prefix}floor_ttft_p50_ms']:8.1f} p99 "
                f"{floor[f'{prefix}floor_ttft_p99_ms']:8.1f} ms (alone, idle, {what})",
                flush=True,
            )
    rows = []
    for router in routers:
        row = {"workload": w.name, "router": router, **pooled_row(runs[router]), **floor}
        row["cache_blocks_per_engine"] = {str(r.seed): r.cache_blocks or args.cache_blocks for r in slices}
        row["working_set_blocks"] = {str(r.seed): r.working_set for r in slices}
        rows.append(row)
        if len(args.seeds) > 1:
            _print_row(w.name, router, None, row)
    return rows


def _print_row(name: str, router: str, seed: int | None, row: dict[str, Any]) -> None:
    def ms(key: str) -> float:
        value = row.get(key)
        return float("nan") if value is None else float(value)

    print(
        f"{name:12} {router:20} ({'seed ' + str(seed) if seed is not None else 'pooled':>8}) hit "
        f"{row['hit_rate']:.3f} ttft p50 {row['ttft_p50_ms']:8.1f} p99 {row['ttft_p99_ms']:8.1f} ms "
        f"(engine p99 {ms('engine_ttft_p99_ms'):8.1f}; hop in / out p50 {ms('inbound_p50_ms'):5.1f} / "
        f"{ms('outbound_p50_ms'):5.1f}; "
        f"router CPU {ms('router_cpu_ms_per_request'):5.2f} ms/req)  "
        f"{row['throughput_rps']:6.2f} req/s errors {row['errors']}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="requests replayed per workload")
    ap.add_argument(
        "--workloads",
        nargs="+",
        help="agent, mooncake, kv_pressure, hetero, decode_heavy, trace (default: the first five; "
        "only trace when --trace is given)",
    )
    ap.add_argument("--trace", type=Path, help="a Mooncake-format trace to replay (the trace workload)")
    ap.add_argument(
        "--routers", nargs="+", default=["kvgate_kv_aware", "sglang_cache_aware", "vllm_router_best"]
    )
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument(
        "--cache-blocks",
        type=int,
        default=400,
        help="KV blocks per engine (16 tokens each): small, so caches evict",
    )
    ap.add_argument("--max-blocks", type=int, default=48, help="trace blocks per prompt at most")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--speedup", type=float, default=4.0)
    ap.add_argument("--time-scale", type=float, default=0.25)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[5, 6, 7],
        help="each seed a slice of the workload replayed through every router; a row pools them "
        "(bench/live_pool.py: a p99 of one 300-request replay moves 0.2-0.4 between runs)",
    )
    ap.add_argument("--seed", type=int, help="one seed only (the same as --seeds SEED)")
    ap.add_argument(
        "--no-floor",
        action="store_true",
        help="skip each workload's TTFT floor (its requests alone on an idle engine, bench/live_floor.py)",
    )
    ap.add_argument(
        "--lru-floor",
        action="store_true",
        help="also each workload's fleet-LRU floor: its requests alone on an idle engine whose cache "
        "is the fleet's KV in all, LRU (bench/live_floor.py)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/live.json")
    ap.add_argument("--kvgate-params", type=json.loads, default={}, help="kv_aware parameters (JSON object)")
    ap.add_argument(
        "--kvgate-workers", type=int, default=1, help="kvgate's server.workers (its audit read from one: 1)"
    )
    ap.add_argument(
        "--kvgate-config",
        type=json.loads,
        default={},
        help='kvgate config settings laid over the bench\'s (JSON object, e.g. {"proxy": '
        '{"tokenize_offload_chars": 2048}}); --kvgate-workers sets server.workers',
    )
    args = ap.parse_args(argv)
    if args.seed is not None:
        args.seeds = [args.seed]
    if args.kvgate_workers != 1:
        args.kvgate_config = merged(args.kvgate_config, {"server": {"workers": args.kvgate_workers}})
    if args.workloads is None:
        args.workloads = (
            ["trace"] if args.trace else ["agent", "mooncake", "kv_pressure", "hetero", "decode_heavy"]
        )
    routers = [r for r in args.routers if r.startswith("kvgate") or (BENCH_VENV / "bin/python").exists()]
    rows = [row for wl in args.workloads for row in workload_rows(wl, routers, args)]
    write_results(args.out, {"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
