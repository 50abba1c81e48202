"""Gateway overhead: the same seeded chat requests straight to fast fake backends and through
each router, in one run, interleaved per scenario.

Routers: kvgate (``kvgate serve``, kv_aware, the 32k benchmark tokenizer, so tokenization and
block keys are included) as one process and with ``--workers 2`` (``kvgate_workers2``), and,
when ``.venv-bench`` holds them, sglang-router (cache_aware and round_robin) and vllm-router (cache_aware: its best policy without engine KV events, which fake
backends do not publish). Scenarios: non-streaming and streaming, 2 KB and 8 KB prompts,
concurrency 32 and 128 (closed loop), plus concurrency 1 (the unloaded added latency); and warm
8 KB chats (a pool of 64 resent: the gateway's caches hit) at concurrency 1 and 32, where the
headline CPU per request is read.

Per router and scenario: requests/s, latency p50/p99, added latency (router minus direct at the
same percentile), CPU seconds per 1,000 requests of the router's process tree (from /proc), and
requests/s per router CPU core (= requests / router CPU seconds). The machine's cores are shared
by the load generator, the backends and the router, so requests/s and latency are only compared
side by side within one run; CPU per request is the robust figure.

    .venv/bin/python -m bench.overhead [--requests 2000] [--out bench/results/overhead.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import uvloop
import yaml

from bench import loadgen
from bench.cpu_time import tree_cpu_s, tree_threads_cpu_s
from bench.results_file import write_results
from gateway.features.featurizer import BACKGROUND_THREAD_NAME
from kvgate_tools.procs import ProcessGroup, Ready, free_port

ROOT = Path(__file__).resolve().parent.parent
BENCH_VENV = ROOT / ".venv-bench"
TOKENIZER = ROOT / "assets/tokenizers/kvgate-bench-32k"
MODEL = "bench-model"
DEFERRED_THREAD = BACKGROUND_THREAD_NAME.decode()
PATH = "/v1/chat/completions"
# kvgate as one process, and with two workers (``kvgate serve --workers 2``, docs/architecture.md
# "Workers"): their CPU is their whole process tree's
KVGATE_ROUTERS = (("kvgate", 1), ("kvgate_workers2", 2))


def kvgate_config(backends: list[int], tokenizer: Path, policy: str = "kv_aware") -> dict[str, Any]:
    return {
        "listen": {"http": "127.0.0.1:0", "inventory": "127.0.0.1:0"},
        "policy": {"name": policy},
        "models": [{"name": MODEL, "tokenizer": str(tokenizer), "block_size": 16}],
        "replicas": [
            {"id": f"b{i}", "url": f"http://127.0.0.1:{p}", "models": [MODEL]} for i, p in enumerate(backends)
        ],
        "telemetry": {"access_log": False, "log_level": "WARNING"},
    }


def start_routers(
    procs: ProcessGroup, backends: list[int], tmp: Path, peers: bool, only: list[str] | None = None
) -> dict[str, tuple[int, int]]:
    """Start every router; returns name -> (port, pid)."""
    routers: dict[str, tuple[int, int]] = {}
    urls = [f"http://127.0.0.1:{p}" for p in backends]
    want = set(only) if only else None
    for name, workers in KVGATE_ROUTERS:
        if want is not None and name not in want:
            continue
        cfg = tmp / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({**kvgate_config(backends, TOKENIZER), "server": {"workers": workers}}))
        proc, m = procs.start(
            name,
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)],
            Ready(pattern=r"kvgate serve: http=[\d.]+:(\d+)"),
        )
        assert m is not None
        routers[name] = (int(m.group(1)), proc.pid)
    if not peers:
        return routers
    py = BENCH_VENV / "bin/python"
    if not py.exists():
        print("overhead: .venv-bench missing, peers skipped (make bench creates it)", file=sys.stderr)
        return routers
    for policy in ("cache_aware", "round_robin"):
        name = f"sglang_{policy}"
        if want is not None and name not in want:
            continue
        port = free_port()
        proc, _ = procs.start(
            name,
            [
                str(py), "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--policy", policy,
                "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
                "--log-level", "warn", "--model-path", str(TOKENIZER),
            ],
            Ready(url=f"http://127.0.0.1:{port}/v1/models"),
            extra_env={"HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        routers[name] = (port, proc.pid)
    if want is None or "vllm_router_cache_aware" in want:
        port = free_port()
        proc, _ = procs.start(
            "vllm_router_cache_aware",
            [
                str(BENCH_VENV / "bin/vllm-router"), "--worker-urls", *urls, "--policy", "cache_aware",
                "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
                "--log-level", "warning",
            ],
            Ready(url=f"http://127.0.0.1:{port}/v1/models"),
            extra_env={"HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        routers["vllm_router_cache_aware"] = (port, proc.pid)
    return routers


WARM_POOL = 64


def warmup_requests(count: int, concurrency: int) -> int:
    """Requests sent before a measurement of ``count`` at ``concurrency`` (not measured)."""
    return max(min(count // 10 + concurrency, 200), WARM_POOL)


def start_fake_backends(procs: ProcessGroup, count: int, *flags: str) -> list[int]:
    """``count`` fake backends in one process (bench/fake_backend.py, more ``flags`` for it):
    their ports. Every hop benchmark starts its backends here."""
    _, m = procs.start(
        "fake_backend",
        [sys.executable, "-m", "bench.fake_backend", "--ports", *["0"] * count, "--model", MODEL, *flags],
        Ready(pattern=r"fake_backend: ports=([\d,]+)"),
    )
    assert m is not None
    return [int(p) for p in m.group(1).split(",")]


# Priming sends each warm body this many times over as many connections. A process of kvgate
# needs two sightings of a text (below); ``--workers N`` processes share the listening port and
# the kernel gives each connection to one of them, so a body sent over one connection only warms
# one worker's caches (the others' memo and segment caches are their own). With 16 sends over 16
# connections a body misses one of two workers' second sighting with probability
# P(Binomial(16, 1/2) <= 1) = 17 / 65536.
PRIME_SENDS = 16


def prime(port: int, pid: int, bodies: list[bytes]) -> None:
    """Make ``bodies`` warm in a router: each sent at least twice to every process that serves
    the port (kvgate routes a text it has never seen before encoding it, then encodes it in the
    background; the second sighting takes the exact path and fills the memo), then wait until
    the router's CPU is idle again, so that no background work of the priming is charged to, or
    competes with, the measured requests. The first pass (each body twice in a row, one
    connection) is the priming every run before 2026-12-02 06:27 used, so that one process's
    figures stay comparable with theirs; the second reaches the other workers."""
    uvloop.run(loadgen.run("127.0.0.1", port, PATH, bodies, 2 * len(bodies), 1, 60.0))
    sends = PRIME_SENDS * len(bodies)
    uvloop.run(loadgen.run("127.0.0.1", port, PATH, bodies, sends, PRIME_SENDS, 60.0))
    for _ in range(100):  # at most ~10 s
        before = tree_cpu_s(pid)
        time.sleep(0.1)
        if tree_cpu_s(pid) - before < 0.005:  # under 5% of a core: idle (health checks, timers)
            return


def measure(
    port: int, pid: int | None, bodies: list[bytes], count: int, concurrency: int, max_s: float
) -> dict[str, float]:
    warmup = warmup_requests(count, concurrency)
    cpu0 = tree_cpu_s(pid) if pid else 0.0
    bg0 = tree_threads_cpu_s(pid, DEFERRED_THREAD) if pid else 0.0
    res = uvloop.run(loadgen.run("127.0.0.1", port, PATH, bodies, count, concurrency, max_s, warmup=warmup))
    cpu = (tree_cpu_s(pid) - cpu0) if pid else 0.0
    background = (tree_threads_cpu_s(pid, DEFERRED_THREAD) - bg0) if pid else 0.0
    out = res.summary()
    n = out["requests"] + warmup
    out["cpu_s"] = cpu
    out["cpu_s_per_1000"] = 1000 * cpu / n if pid else 0.0
    # of which kvgate's lowest-priority threads encoding new text after routing, in every process
    # of its tree (0 for others)
    out["deferred_cpu_s_per_1000"] = 1000 * background / n if pid else 0.0
    out["rps_per_core"] = n / cpu if cpu > 0 else 0.0
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    scenarios = [
        (stream, size, conc, False)
        for stream in (False, True)
        for size in args.sizes
        for conc in args.concurrency
    ]
    # warm: the same 8 KB chats resent (a pool of WARM_POOL, primed in each router first: ``prime``):
    # what the gateway's caches are for; the headline CPU per request (issue 15) is measured here
    scenarios += [(False, 8192, conc, True) for conc in args.warm_concurrency]
    rows: list[dict[str, Any]] = []
    tmp = args.out.parent / "tmp" / "overhead"
    with ProcessGroup(tmp) as procs:
        backends = start_fake_backends(procs, args.backends)
        routers = start_routers(procs, backends, tmp, peers=not args.no_peers, only=args.routers)
        time.sleep(1.0)  # first health rounds
        for point, (stream, size, conc, warm) in enumerate(scenarios):
            count = args.requests if conc > 1 else max(args.requests // 4, 50)
            # unique: every request a new user message after one of 16 shared system prompts, so
            # that each one pays for tokenizing its new text, as a chat workload does; warm: a
            # pool of WARM_POOL such chats, resent (the warm-up sends each at least once)
            n = WARM_POOL if warm else count + warmup_requests(count, conc)
            bodies = loadgen.chat_bodies(n, size, stream, seed=args.seed * 1000 + point, model=MODEL)
            direct = measure(backends[0], None, bodies, count, conc, args.max_seconds)
            row: dict[str, Any] = {
                "warm": warm,
                "stream": stream,
                "prompt_bytes": size,
                "concurrency": conc,
                "direct": direct,
            }
            for name, (port, pid) in routers.items():
                if warm:
                    prime(port, pid, bodies)
                r = measure(port, pid, bodies, count, conc, args.max_seconds)
                r["added_p50_ms"] = r["p50_ms"] - direct["p50_ms"]
                r["added_p99_ms"] = r["p99_ms"] - direct["p99_ms"]
                row[name] = r
            rows.append(row)
            print(format_row(row), flush=True)
    return {
        "requests_per_point": args.requests,
        "backends": args.backends,
        "tokenizer": str(TOKENIZER.relative_to(ROOT)),
        "rows": rows,
    }


def format_row(row: dict[str, Any]) -> str:
    head = (
        f"{'warm  ' if row.get('warm') else ''}"
        f"{'stream' if row['stream'] else 'json  '} {row['prompt_bytes'] // 1024}KB c={row['concurrency']:<3} "
        f"direct {row['direct']['rps']:7.0f} rps p50 {row['direct']['p50_ms']:6.2f}ms"
    )
    parts = [head]
    for name, r in row.items():
        if isinstance(r, dict) and name != "direct":
            parts.append(
                f"  {name}: {r['rps']:6.0f} rps +p50 {r['added_p50_ms']:6.2f} +p99 {r['added_p99_ms']:6.2f}ms "
                f"cpu/1k {r['cpu_s_per_1000']:5.2f}s rps/core {r['rps_per_core']:6.0f} err {r['errors']:.0f}"
            )
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="measured requests per point")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--warm-concurrency", type=int, nargs="*", default=[1, 32], help="warm 8 KB chat points")
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--max-seconds", type=float, default=60.0, help="time bound of one point")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--no-peers", action="store_true", help="kvgate only")
    ap.add_argument("--routers", nargs="+", default=None, help="subset of routers to run")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/overhead.json")
    args = ap.parse_args(argv)
    result = run(args)
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
