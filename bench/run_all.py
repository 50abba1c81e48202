"""Run every benchmark and the report: ``make bench`` (full sizes) and ``make bench-quick``.

    .venv/bin/python -m bench.run_all [--quick] [--results bench/results] [--no-peers]

Full: index at 1M and 10M blocks over 8 and 64 replicas; overhead at 2 KB / 8 KB, concurrency 1,
32 and 128, streaming and not, 2,000 requests per point; streamed 256-token answers at a 20 ms
inter-token gap, concurrency 32, 128 and 256 (bench/streaming.py); live fleet of 4 engines, 300 requests of
each workload for each of three seeds, pooled (bench/live_workloads.py, bench/live_pool.py); the new-replica share (bench/new_replica.py). Quick: the
same parts at small sizes (8 KB prompts only, 200 requests per point, one streamed answer per
connection at concurrency 32 and a 10 ms gap,
16 live requests of the agent workload only on 2 engines, one seed — process start-up dominates there;
about two minutes on 2 busy cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench import index_bench, live, new_replica, overhead, report, streaming

ROOT = Path(__file__).resolve().parent.parent


# the quick live part: 16 agent-workload requests on 2 engines, one seed
QUICK_LIVE = ["--requests", "16", "--replicas", "2", "--speedup", "8", "--workloads", "agent", "--seed", "5"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", type=Path, default=ROOT / "bench/results")
    ap.add_argument("--no-peers", action="store_true", help="kvgate only (no .venv-bench routers)")
    ap.add_argument("--parts", nargs="+", default=["index", "overhead", "streaming", "live", "new_replica"])
    args = ap.parse_args(argv)
    res = args.results
    res.mkdir(parents=True, exist_ok=True)
    q = args.quick
    t0 = time.monotonic()
    if "index" in args.parts:
        sizes = ["200000"] if q else ["1000000", "10000000"]
        index_bench.main(
            ["--blocks", *sizes, "--replicas", "8", "64", "--out", str(res / "index.json")]
            + (["--churn-events", "100000", "--match-reps", "20"] if q else [])
        )
    if "overhead" in args.parts:
        overhead.main(
            ["--out", str(res / "overhead.json")]
            + (
                ["--requests", "200", "--sizes", "8192", "--concurrency", "32", "--backends", "2"]
                if q
                else []
            )
            + (["--no-peers"] if args.no_peers else [])
        )
    if "streaming" in args.parts:
        streaming.main(
            ["--out", str(res / "streaming.json")]
            + (["--quick"] if q else [])
            + (["--no-peers"] if args.no_peers else [])
        )
    if "live" in args.parts:
        live.main(
            ["--out", str(res / "live.json")]
            + (QUICK_LIVE if q else [])
            + (["--routers", "kvgate_kv_aware"] if args.no_peers else [])
        )
    if "new_replica" in args.parts:
        new_replica.main(["--out", str(res / "new_replica.json")])
    report.main(["--results", str(res)])
    print(f"run_all: {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
