"""``kvgate serve --workers N`` (docs/architecture.md, "Workers"): throughput with 1 and 2 workers
against the same fast fake backends, the staleness between workers, and the memory per block.

* **scaling**: the overhead benchmark's warm 8 KB chat requests (bench/overhead.py's config and
  ``measure``: closed loop, requests/s, latency, CPU of the gateway's process tree per request),
  once per worker count, each gateway started fresh;
* **staleness**: a test agent streams one stored block at a time to a 2-worker gateway; the time
  from the agent's send to the block being listed by ``GET /admin/index?replica=`` in every
  worker (polled as fast as HTTP allows, so an upper bound);
* **memory**: RSS of the parent and of each worker before and after the agent's snapshot of
  ``--blocks`` blocks (every process holds a copy).

The load generator runs in this process: on a small host it competes with the gateway's workers
for the cores, which caps what a second worker can add (say so when reporting).

    .venv/bin/python -m bench.workers_scaling [--requests 3000] [--out bench/results/workers.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench import loadgen
from bench.cpu_time import tree_pids
from bench.overhead import MODEL, TOKENIZER, kvgate_config, measure, start_fake_backends
from bench.results_file import write_results
from kvgate_tools.local_fleet import http
from kvgate_tools.procs import ProcessGroup, Ready
from kvgate_tools.stream_agent import StreamAgent
from proto.kvgate.v1 import inventory_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
KEY_BASE = 1 << 40
AGENT_TOKEN = "bench-agent-token"


def start_gateway(
    procs: ProcessGroup, tmp: Path, backends: list[int], workers: int, **extra: Any
) -> tuple[int, int, subprocess.Popen[bytes]]:
    """(http port, inventory port, process) of a fresh gateway with ``workers`` workers."""
    name = f"kvgate-w{workers}-{extra.pop('tag', 'scaling')}"  # one log per gateway
    cfg = kvgate_config(backends, TOKENIZER)
    cfg["server"] = {"workers": workers}
    cfg["auth"] = {"agent_token_env": "KVGATE_BENCH_AGENT_TOKEN"}
    cfg.update(extra)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc, m = procs.start(
        name,
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
        Ready(pattern=r"kvgate serve: http=[\d.]+:(\d+) inventory=[\d.]+:(\d+)"),
        extra_env={"KVGATE_BENCH_AGENT_TOKEN": AGENT_TOKEN},
    )
    assert m is not None
    return int(m.group(1)), int(m.group(2)), proc


def scaling(procs: ProcessGroup, tmp: Path, backends: list[int], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for workers in args.workers:
        port, _, proc = start_gateway(procs, tmp, backends, workers)
        time.sleep(1.0)  # first health rounds
        runs = []
        for rep in range(args.repeats):
            bodies = loadgen.chat_bodies(
                args.requests + 200, args.prompt_bytes, False, seed=args.seed + rep, model=MODEL
            )
            run = measure(port, proc.pid, bodies, args.requests, args.concurrency, args.max_seconds)
            # measure counts the lowest-priority encode threads of every process: work a saturated
            # gateway sheds (its bounded backlog drops), so CPU per request without it is the
            # request path's
            run["deferred_cpu_ms_per_request"] = run["deferred_cpu_s_per_1000"]
            run["request_path_cpu_ms_per_request"] = run["cpu_s_per_1000"] - run["deferred_cpu_s_per_1000"]
            runs.append(run)
        best = max(runs, key=lambda r: r["rps"])
        best["cpu_ms_per_request"] = best["cpu_s_per_1000"]
        out[f"workers{workers}"] = {**best, "rps_runs": [r["rps"] for r in runs]}
        print(f"workers={workers}: {best['rps']:.0f} req/s (runs {[round(r['rps']) for r in runs]}), "
              f"p50 {best['p50_ms']:.2f} ms, p99 {best['p99_ms']:.2f} ms, "
              f"CPU {best['cpu_s_per_1000']:.2f} ms/request "
              f"(request path {best['request_path_cpu_ms_per_request']:.2f}, "
              f"deferred encodes {best['deferred_cpu_ms_per_request']:.2f})", flush=True)  # fmt: skip
        procs.stop(proc)
    if "workers1" in out and "workers2" in out:
        out["workers2_throughput_vs_workers1"] = out["workers2"]["rps"] / out["workers1"]["rps"]
    return out


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _index_in_every_worker(port: int, replica: str, check: Any, workers: int = 2) -> None:
    seen: set[str] = set()
    while len(seen) < workers:
        query = f"?replica={replica}" if replica else ""
        _, headers, body = http("GET", f"http://127.0.0.1:{port}/admin/index{query}")
        if body and check(json.loads(body)):
            seen.add(headers.get("x-kvgate-worker", "0"))


def staleness_and_memory(
    procs: ProcessGroup, tmp: Path, backends: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    index = {"max_blocks_per_replica": 4 * args.blocks, "max_total_blocks": 8 * args.blocks}
    port, inv, proc = start_gateway(procs, tmp, backends, 2, index=index, tag="staleness")
    pid = proc.pid
    time.sleep(1.0)
    agent = StreamAgent(inv, AGENT_TOKEN)
    agent.send(hello=pb.Hello(replica_id="agent0", url="http://127.0.0.1:9", models=[MODEL], block_size=16,
                              engine="bench", protocol_version=1))  # fmt: skip
    agent.send(snapshot=pb.SnapshotChunk(snapshot_id=1, keys=[], medium="GPU", last=True))
    _index_in_every_worker(port, "agent0", lambda d: d.get("replica") == "agent0")
    lags = []
    for i in range(args.staleness_samples):
        key = KEY_BASE + i
        t0 = time.perf_counter()
        agent.send(events=pb.Events(events=[pb.Event(stored=pb.Stored(keys=[key]))]))
        _index_in_every_worker(port, "agent0", lambda d, k=key: k in d["keys"])
        lags.append((time.perf_counter() - t0) * 1e3)
    before = {p: _rss_kb(p) for p in tree_pids(pid)}
    keys = list(range(2 * KEY_BASE, 2 * KEY_BASE + args.blocks))
    t0 = time.perf_counter()
    for start in range(0, len(keys), 65536):
        chunk = keys[start : start + 65536]
        last = start + 65536 >= len(keys)
        agent.send(snapshot=pb.SnapshotChunk(snapshot_id=2, keys=chunk, medium="GPU", last=last))
    _index_in_every_worker(port, "", lambda d: d.get("entries", 0) >= args.blocks)
    snapshot_s = time.perf_counter() - t0
    after = {p: _rss_kb(p) for p in tree_pids(pid)}
    agent.close()
    per_block = {str(p): 1024 * (after[p] - before.get(p, 0)) / args.blocks for p in after}
    lags.sort()
    return {
        "staleness_ms": {
            "samples": len(lags),
            "p50": statistics.median(lags),
            "p99": lags[min(len(lags) - 1, int(0.99 * len(lags)))],
            "max": lags[-1],
            "note": "agent send -> listed by /admin/index in both workers, HTTP polling included",
        },
        "memory": {
            "blocks": args.blocks,
            "rss_bytes_per_block_by_pid": per_block,
            "processes": len(after),
            "snapshot_to_every_worker_s": snapshot_s,
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000, help="measured requests per run")
    ap.add_argument("--repeats", type=int, default=2, help="runs per worker count (best kept)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompt-bytes", type=int, default=8192)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--max-seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--blocks", type=int, default=200_000, help="blocks of the memory measurement")
    ap.add_argument("--staleness-samples", type=int, default=200)
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/workers.json")
    args = ap.parse_args(argv)
    tmp = args.out.parent / "tmp" / "workers"
    shutil.rmtree(tmp, ignore_errors=True)  # each run's logs only
    result: dict[str, Any] = {"concurrency": args.concurrency, "prompt_bytes": args.prompt_bytes}
    with ProcessGroup(tmp) as procs:
        backends = start_fake_backends(procs, args.backends)
        if not args.skip_scaling:
            result["scaling"] = scaling(procs, tmp, backends, args)
        result |= staleness_and_memory(procs, tmp, backends, args)
    print(json.dumps({k: v for k, v in result.items() if k != "scaling"}, indent=1))
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
