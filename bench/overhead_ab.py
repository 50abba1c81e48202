"""Interleaved A/B of the gateway's CPU per request and its unloaded tail between source trees
(docs/performance.md, "Third pass"): on a shared machine only paired figures mean anything.

Each round starts ``kvgate serve`` (one process, or ``--workers N``) from every tree in turn, the order alternating
between rounds, all on the same fake backends, and takes ``bench/overhead.py``'s own measurement:
``prime`` of the 64 warm 8 KB chats, then ``measure`` of warm chats at concurrency 32 (``--reps``
times ``--requests``: CPU of the gateway's process tree per request), then unique 8 KB chats at
concurrency 1 (``--c1`` requests, the same seeded bodies for every tree of a round: the added
latency against the backend measured directly just before, and kvgate's deferred-encode counters
over that run: takeovers of a queued job's head, heads the worker encoded first); with ``--unique N``,
N unique 8 KB chats at c=32 that fill the gateway's records of new text, then the CPU per unique
chat over ``--requests`` more (docs/performance.md, "The seen-text record"). One JSON line per
run, and a summary per tree at the end (CPU ms per request min / median, c=1 added p99 median /
min / max).

    .venv/bin/python -m bench.overhead_ab --trees base=/path/to/base branch=. [--rounds 8] [--out ab.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench import live_metrics, loadgen, overhead
from kvgate_tools.procs import ProcessGroup, Ready
from kvgate_tools.prom_text import sums

WARM_SEED = 11099
DEFERRED_COUNTERS = {  # per c=1 run: requests taking a queued head over, heads the worker took first
    "expedited_heads": "kvgate_tokenize_deferred_expedited_heads_total",
    "heads_first": "kvgate_tokenize_deferred_heads_first_total",
}


def _one(
    procs: ProcessGroup,
    tree: Path,
    cfg: Path,
    bodies: tuple[list[bytes], list[bytes], list[bytes]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One gateway start from ``tree``: warm CPU per request (``args.reps`` runs), the c=1 run,
    and with ``args.unique`` the CPU per unique chat at c=32 once that many have filled the
    gateway's records of new text (a long-running gateway's state: the fresh one's records are
    empty)."""
    warm, unique, fill = bodies
    procs.cwd = tree
    proc, m = procs.start(
        f"kvgate_{tree.name}",
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)],
        Ready(pattern=r"kvgate serve: http=[\d.]+:(\d+)"),
        extra_env={"PYTHONPATH": str(tree)},
    )
    assert m is not None
    try:
        port = int(m.group(1))
        time.sleep(1.0)  # first health rounds
        overhead.prime(port, proc.pid, warm)
        cpu = [
            overhead.measure(port, proc.pid, warm, args.requests, 32, 60.0)["cpu_s_per_1000"]
            for _ in range(args.reps)
        ]
        before = _deferred_counts(port)
        c1 = overhead.measure(port, proc.pid, unique, args.c1, 1, 120.0)
        after = _deferred_counts(port)
        # the new chats' deferred encodes: takeovers of a queued job's head on a request's path,
        # and heads the background worker encoded first (counters absent from an older tree: 0)
        c1_deferred = {k: round(after[k] - before[k]) for k in after}
        row: dict[str, Any] = {"cpu_ms": [round(c, 4) for c in cpu], "c1": c1, "c1_deferred": c1_deferred}
        if args.unique:
            overhead.measure(port, proc.pid, fill[: args.unique], args.unique, 32, 300.0)
            full = overhead.measure(port, proc.pid, fill[args.unique :], args.requests, 32, 120.0)
            row["unique_full_cpu_ms"] = round(full["cpu_s_per_1000"], 4)
        return row
    finally:
        procs.stop(proc)


def _deferred_counts(port: int) -> dict[str, float]:
    """kvgate's deferred-encode counters from its /metrics (0 for one the tree does not export)."""
    got = sums([live_metrics.scrape(f"http://127.0.0.1:{port}")], DEFERRED_COUNTERS.values())
    return {short: got[name] for short, name in DEFERRED_COUNTERS.items()}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    trees = {name: Path(path).resolve() for name, _, path in (t.partition("=") for t in args.trees)}
    rows: list[dict[str, Any]] = []
    tmp = args.out.parent / "tmp" / "overhead_ab"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with ProcessGroup(tmp) as procs, args.out.open("a") as out:
        backends = overhead.start_fake_backends(procs, 4)
        cfg = tmp / "kvgate.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {**overhead.kvgate_config(backends, overhead.TOKENIZER), "server": {"workers": args.workers}}
            )
        )
        warm = loadgen.chat_bodies(overhead.WARM_POOL, 8192, False, seed=WARM_SEED, model=overhead.MODEL)
        for r in range(args.rounds):
            names = list(trees) if r % 2 == 0 else list(trees)[::-1]
            unique = loadgen.chat_bodies(
                args.c1 + overhead.warmup_requests(args.c1, 1),
                8192,
                False,
                seed=5000 + r,
                model=overhead.MODEL,
            )
            fill = loadgen.chat_bodies(
                args.unique + args.requests + overhead.warmup_requests(args.requests, 32)
                if args.unique
                else 0,
                8192,
                False,
                seed=9000 + r,
                model=overhead.MODEL,
            )
            direct = overhead.measure(backends[0], None, unique, args.c1, 1, 120.0)
            for name in names:
                res = _one(procs, trees[name], cfg, (warm, unique, fill), args)
                c1 = res.pop("c1")
                row = {
                    "round": r,
                    "tree": name,
                    **res,
                    "c1_added_p50": round(c1["p50_ms"] - direct["p50_ms"], 3),
                    "c1_added_p99": round(c1["p99_ms"] - direct["p99_ms"], 3),
                    "c1_cpu_ms": round(c1["cpu_s_per_1000"], 3),
                    "load": round(os.getloadavg()[0], 2),
                }
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
                rows.append(row)
    return rows


def summary(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for tree in dict.fromkeys(r["tree"] for r in rows):
        cpu = [c for r in rows if r["tree"] == tree for c in r["cpu_ms"]]
        p99 = [r["c1_added_p99"] for r in rows if r["tree"] == tree]
        heads = [r["c1_deferred"]["expedited_heads"] for r in rows if r["tree"] == tree]
        full = [r["unique_full_cpu_ms"] for r in rows if r["tree"] == tree and "unique_full_cpu_ms" in r]
        lines.append(
            f"{tree}: CPU ms/request min {min(cpu):.3f} median {statistics.median(cpu):.3f} ({len(cpu)} runs); "
            f"c=1 added p99 median {statistics.median(p99):.2f} (min {min(p99):.2f}, max {max(p99):.2f}); "
            f"c=1 takeovers of a head {min(heads)}-{max(heads)} per run"
            + (
                f"; unique chats, records full: CPU ms/request median {statistics.median(full):.3f}"
                if full
                else ""
            )
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", required=True, help="name=path of each source tree")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--workers", type=int, default=1, help="kvgate's server.workers")
    ap.add_argument("--reps", type=int, default=3, help="warm c=32 measurements per gateway start")
    ap.add_argument("--requests", type=int, default=3000, help="requests per warm measurement")
    ap.add_argument("--c1", type=int, default=800, help="unique chats in the c=1 run")
    ap.add_argument(
        "--unique",
        type=int,
        default=0,
        help="unique chats at c=32 that fill the gateway's records of new text before a measurement of "
        "--requests more (0: none)",
    )
    ap.add_argument("--out", type=Path, default=overhead.ROOT / "bench/results/tmp/overhead_ab.jsonl")
    args = ap.parse_args(argv)
    print("\n".join(summary(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
