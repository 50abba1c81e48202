"""Streaming relay cost: long SSE answers (one token per event, as engines send them) paced at a
realistic inter-token gap, through each router in turn (docs/performance.md, "Streaming").

Backends: ``bench.fake_backend --chunks 0 --gap-ms G``: each listener is an engine that answers a
streamed request with ``max_tokens`` events, one per decode step of G ms (all the streams of one
listener tick together, as a batch does), then a usage event (the requests ask for
``stream_options.include_usage``, so kvgate's prediction audit reads the stream's tail) and
``[DONE]``. Routers: kvgate (kv_aware), sglang-router cache_aware, vllm-router cache_aware, started
by ``bench.overhead.start_routers``.

Per router and concurrency (closed loop, ``--rounds`` answers per connection):

* ``events_per_s``: SSE events delivered to the clients per second (the backends set the pace:
  about concurrency / gap; a router that keeps up matches the direct figure);
* ``cpu_us_per_chunk``: the CPU the router spends per relayed event, net of what it spends per
  request:  ((C_N - I * T_N) / R - (C_1 - I * T_1) / R) / (N - 1)  where C_N is the router
  process tree's CPU for R requests of N events each, C_1 the same for R requests with the same
  prompt sizes (other seeded prompts, so that neither run hits the other's caches) and one event
  each, I the router's idle CPU rate (its health checks and timers, measured once before any
  request) and T the runs' windows. A run's window lasts until the router is back to its idle
  rate, so that work it leaves behind (kvgate encodes new prompt text on a background thread
  after routing) is charged to it, not to the next run. CPU is read from the kernel's
  per-process CPU clock (nanoseconds), not /proc's 10 ms ticks: a Rust router spends a few
  milliseconds per thousand events. (One event per chunk: the backends write each event as its
  own HTTP chunk, a router may merge events that arrive together);
* client TTFT and the gap between consecutive events, p50/p99, and what the router adds to them
  (router minus direct at the same percentile, measured in the same run).

Summary (``summary`` in the output): each router's CPU per chunk at every concurrency, and
``cpu_per_chunk_vs_sglang_cache_aware``: kvgate's CPU per chunk over sglang-router cache_aware's,
the highest ratio over the concurrencies run (None without the peers).

    .venv/bin/python -m bench.streaming [--quick] [--out bench/results/streaming.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from bench import loadgen
from bench.overhead import MODEL, PATH, start_fake_backends, start_routers
from bench.results_file import write_results
from kvgate_tools.procs import ProcessGroup

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "sglang_cache_aware"
ROUTERS = ("kvgate", BASELINE, "vllm_router_cache_aware")


def _process_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` (all its threads) from its kernel CPU clock, ns precision
    (clockid = MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)); 0 once it is gone."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        return 0.0


def tree_pids(root: int) -> list[int]:
    """``root`` and its live descendants (a router's tree does not change during a run)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(raw[raw.rindex(")") + 2 :].split()[1])
    out = []
    for pid in parents:
        p = pid
        while p and p != root:
            p = parents.get(p, 0)
        if p == root:
            out.append(pid)
    return out


def tree_cpu_s(pids: list[int]) -> float:
    return sum(_process_cpu_s(p) for p in pids)


@dataclass(frozen=True)
class Meter:
    """A router's process tree and its idle CPU rate (CPU seconds per second, measured before any
    request: its health checks and timers)."""

    pids: list[int]
    idle: float


def idle_cpu_rate(pids: list[int], seconds: float) -> float:
    """The process tree's CPU seconds per second over ``seconds`` with no request in flight."""
    cpu0, t0 = tree_cpu_s(pids), time.perf_counter()
    time.sleep(seconds)
    return (tree_cpu_s(pids) - cpu0) / (time.perf_counter() - t0)


def settle(meter: Meter, limit_s: float = 10.0, step_s: float = 0.25) -> None:
    """Wait (at most ``limit_s``) until the router is back to its idle rate: work a run left behind
    (kvgate encodes new prompt text on a background thread after routing) is charged to that run,
    not to the next one."""
    end = time.perf_counter() + limit_s
    while time.perf_counter() < end and idle_cpu_rate(meter.pids, step_s) > 2 * meter.idle + 0.002:
        pass


def measure(
    port: int,
    meter: Meter | None,
    bodies: list[bytes],
    conc: int,
    args: argparse.Namespace,
    long: bool = False,
) -> dict[str, Any]:
    """One closed-loop run of ``bodies``; with a ``meter``, the router tree's CPU seconds from its
    start until the router is idle again (``cpu_s``, over ``cpu_window_s``). ``long`` answers
    start spread over one answer's duration (``loadgen.run_streams``'s stagger)."""
    stagger = args.chunks * args.gap_ms / 1000 if long else 0.0
    cpu0, t0 = (tree_cpu_s(meter.pids) if meter else 0.0), time.perf_counter()
    res = uvloop.run(loadgen.run_streams("127.0.0.1", port, PATH, bodies, conc, args.max_seconds, stagger))
    out: dict[str, Any] = res.summary()
    if meter is not None:
        settle(meter)
        out["cpu_s"] = tree_cpu_s(meter.pids) - cpu0
        out["cpu_window_s"] = time.perf_counter() - t0
    return out


def cpu_per_chunk_us(full: dict[str, Any], one: dict[str, Any], idle: float, chunks: int) -> float:
    """The module docstring's CPU per relayed event, in microseconds."""
    per_full = (full["cpu_s"] - idle * full["cpu_window_s"]) / max(full["ok"], 1)
    per_one = (one["cpu_s"] - idle * one["cpu_window_s"]) / max(one["ok"], 1)
    return float(1e6 * (per_full - per_one) / max(chunks - 1, 1))


def _bodies(args: argparse.Namespace, n: int, seed: int, tokens: int) -> list[bytes]:
    answer = loadgen.Answer(max_tokens=tokens, include_usage=True)
    return loadgen.chat_bodies(n, args.prompt_bytes, True, seed=seed, model=MODEL, answer=answer)


def _point(
    args: argparse.Namespace, routers: dict[str, tuple[int, Meter]], backend: int, conc: int
) -> dict[str, Any]:
    n = conc * args.rounds
    seed = args.seed * 1000 + conc
    full_bodies = _bodies(args, n, seed, args.chunks)
    one_bodies = _bodies(args, n, seed + 1, 1)
    row: dict[str, Any] = {"concurrency": conc, "chunks": args.chunks, "gap_ms": args.gap_ms}
    direct = row["direct"] = measure(backend, None, full_bodies, conc, args, long=True)
    for name, (port, meter) in routers.items():
        # connections opened and the first requests' one-off costs paid before measuring
        measure(port, meter, _bodies(args, conc, seed + 2, 1), conc, args)
        one = measure(port, meter, one_bodies, conc, args)
        full = measure(port, meter, full_bodies, conc, args, long=True)
        full["idle_cpu_per_s"] = meter.idle
        full["one_chunk"] = {k: one[k] for k in ("requests", "errors", "wall_s", "cpu_s", "cpu_window_s")}
        full["cpu_us_per_chunk"] = cpu_per_chunk_us(full, one, meter.idle, args.chunks)
        for k in ("ttft_p50_ms", "ttft_p99_ms", "gap_p50_ms", "gap_p99_ms"):
            full["added_" + k] = full[k] - direct[k]
        row[name] = full
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per router, CPU per chunk (us) and events/s at each concurrency; kvgate over sglang-router
    cache_aware, the highest ratio over the concurrencies (None when either is missing)."""
    per_router: dict[str, dict[str, dict[str, float]]] = {}
    ratios = []
    for row in rows:
        c = str(row["concurrency"])
        for name, r in row.items():
            if isinstance(r, dict) and "cpu_us_per_chunk" in r:
                per_router.setdefault(name, {})[c] = {
                    "cpu_us_per_chunk": round(r["cpu_us_per_chunk"], 3),
                    "events_per_s": round(r["events_per_s"], 1),
                    "added_ttft_p99_ms": round(r["added_ttft_p99_ms"], 3),
                    "added_gap_p99_ms": round(r["added_gap_p99_ms"], 3),
                }
        k, b = row.get("kvgate"), row.get(BASELINE)
        if k is not None and b is not None and b["cpu_us_per_chunk"] > 0:
            ratios.append(k["cpu_us_per_chunk"] / b["cpu_us_per_chunk"])
    return {
        "cpu_per_chunk_vs_sglang_cache_aware": round(max(ratios), 3) if ratios else None,
        "routers": per_router,
    }


def format_row(row: dict[str, Any]) -> str:
    d = row["direct"]
    lines = [
        f"stream {row['chunks']} chunks gap {row['gap_ms']}ms c={row['concurrency']}: direct "
        f"{d['events_per_s']:8.0f} ev/s ttft p50 {d['ttft_p50_ms']:.2f} gap p99 {d['gap_p99_ms']:.2f}ms"
    ]
    for name, r in row.items():
        if isinstance(r, dict) and "cpu_us_per_chunk" in r:
            lines.append(
                f"  {name}: {r['events_per_s']:8.0f} ev/s cpu/chunk {r['cpu_us_per_chunk']:6.2f}us "
                f"+ttft p50 {r['added_ttft_p50_ms']:6.2f} p99 {r['added_ttft_p99_ms']:6.2f} "
                f"+gap p50 {r['added_gap_p50_ms']:5.2f} p99 {r['added_gap_p99_ms']:6.2f}ms "
                f"idle {1000 * r['idle_cpu_per_s']:.1f}ms/s err {r['errors']:.0f}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    tmp = args.out.parent / "tmp" / "streaming"
    # each run's logs only
    shutil.rmtree(tmp, ignore_errors=True)
    with ProcessGroup(tmp) as procs:
        backends = start_fake_backends(procs, args.backends, "--chunks", "0", "--gap-ms", str(args.gap_ms))
        started = start_routers(procs, backends, tmp, peers=not args.no_peers, only=args.routers)
        time.sleep(1.0)  # first health rounds
        routers = {}
        for name, (port, pid) in started.items():
            pids = tree_pids(pid)
            routers[name] = (port, Meter(pids, idle_cpu_rate(pids, args.idle_seconds)))
        for conc in args.concurrency:
            row = _point(args, routers, backends[0], conc)
            rows.append(row)
            print(format_row(row), flush=True)
    return {
        "chunks": args.chunks,
        "gap_ms": args.gap_ms,
        "rounds": args.rounds,
        "prompt_bytes": args.prompt_bytes,
        "backends": args.backends,
        "rows": rows,
        "summary": summarize(rows),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one point at concurrency 32 (seconds)")
    ap.add_argument("--chunks", type=int, default=256, help="SSE events (tokens) per answer")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="inter-token gap of the backends")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 128, 256])
    ap.add_argument("--rounds", type=int, default=3, help="answers per connection and point")
    ap.add_argument("--prompt-bytes", type=int, default=1024)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--idle-seconds", type=float, default=2.0, help="idle CPU measured before each run")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="time bound of one run")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--no-peers", action="store_true", help="kvgate only")
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS), help="subset of routers to run")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/streaming.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.rounds, args.gap_ms, args.idle_seconds = [32], 1, 10.0, 1.0
    result = run(args)
    write_results(args.out, result)
    print("streaming: " + json.dumps(result["summary"]["cpu_per_chunk_vs_sglang_cache_aware"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
