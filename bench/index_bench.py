"""Prefix-index benchmark: block events applied per second, ``match`` latency and bytes per block.

Each (blocks, replicas) configuration runs in a fresh subprocess so that its resident-set delta
belongs to that index alone. The workload mirrors what agents send:

* every replica holds ``blocks / replicas`` entries: 5% are a shared pool of system-prompt chains
  that every replica holds, the rest are per-replica chains of 16..512 blocks;
* a probe chain of 8,192 blocks is held whole by replica 0, its first half by replica 1 and its
  first 64 blocks by every replica, so ``match`` walks the full prompt for at least one replica;
* events arrive as ``Stored``/``Removed`` batches of 1..64 keys (vLLM emits one batch per
  scheduled step, typically a few blocks per request), passed as lists of Python ints, which is
  what the agent stream hands the gateway.

Events/s is measured on a steady-state churn phase at full size (remove an old batch, store a
new one); memory is the RSS delta across the population phase (inputs are generated lazily and
counted against the index, which can only overstate its size) and, separately, tracemalloc's
peak-free current size of the index's allocations.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.results_file import write_results

PROBE_LEN = 8192
MATCH_LENGTHS = (128, 2048, 8192)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096


def _cpu_s() -> float:
    return time.thread_time()


def _load_index_class(path: str) -> Any:
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def _batch_sizes(rng: np.random.Generator, total: int) -> np.ndarray:
    # 1..64 keys per batch, most batches small (geometric with mean ~16)
    sizes = np.minimum(rng.geometric(1 / 16, size=total // 4 + 16), 64)
    ends = np.cumsum(sizes)
    cut = int(np.searchsorted(ends, total))
    sizes = sizes[: cut + 1].copy()
    sizes[-1] -= int(ends[cut]) - total
    return sizes[sizes > 0]


def run_one(
    blocks: int, replicas: int, seed: int, impl: str, churn_events: int, match_reps: int
) -> dict[str, Any]:
    from router_policies.prefix_index import IndexConfig

    rng = np.random.default_rng(seed)
    per_replica = blocks // replicas
    shared_n = max(per_replica // 20, 64)
    probe = rng.integers(1, 2**64, size=PROBE_LEN, dtype=np.uint64)
    shared = rng.integers(1, 2**64, size=shared_n, dtype=np.uint64)
    # per-replica unique keys, generated up front as one uint64 array (before the RSS baseline)
    own_n = []
    for r in range(replicas):
        held_probe = PROBE_LEN if r == 0 else (PROBE_LEN // 2 if r == 1 else 64)
        own_n.append(max(per_replica - shared_n - held_probe + 64, 0))
    own = rng.integers(1, 2**64, size=sum(own_n), dtype=np.uint64)
    churn_keys = rng.integers(1, 2**64, size=churn_events, dtype=np.uint64)
    cls = _load_index_class(impl)
    cfg = IndexConfig(
        max_blocks_per_replica=per_replica + PROBE_LEN + churn_events,
        max_total_blocks=blocks + replicas * PROBE_LEN + churn_events,
        max_replicas=max(replicas, 1),
    )
    # load (and, on a fresh checkout, compile) any lazily built code before the baseline
    warm = cls(cfg)
    warm.add_replica("w")  # the index tracks only replicas it is given (the gateway's Fleet adds them)
    warm.store("w", [1, 2, 3])
    warm.touch_approximate("w", [1, 2, 4], now=0.0)
    warm.match([1, 2, 4])
    warm.holders_of(1)
    warm.remove("w", [1, 2, 3])
    warm.clear_approximate("w")
    warm.clear_replica("w")
    del warm
    gc.collect()
    rss0 = _rss_bytes()
    index = cls(cfg)
    names = [f"r{r}" for r in range(replicas)]
    for name in names:
        index.add_replica(name)
    t_pop = 0.0
    stored = 0
    off = 0
    for r, name in enumerate(names):
        held_probe = PROBE_LEN if r == 0 else (PROBE_LEN // 2 if r == 1 else 64)
        chunks = [probe[:held_probe], shared[64:] if held_probe == 64 else shared, own[off : off + own_n[r]]]
        off += own_n[r]
        for chunk in chunks:
            for size in _batch_sizes(rng, len(chunk)).tolist():
                batch = chunk[:size].tolist()
                chunk = chunk[size:]
                t0 = _cpu_s()
                index.store(name, batch)
                t_pop += _cpu_s() - t0
                stored += len(batch)
    gc.collect()
    rss1 = _rss_bytes()
    entries = int(index.entries)
    distinct = len(index)

    # steady-state churn at full size: remove an old batch of a replica, store a new one
    sizes = _batch_sizes(rng, churn_events // 2).tolist()
    plan: list[tuple[str, list[int], list[int]]] = []
    own_off = [sum(own_n[:r]) for r in range(replicas)]
    c_off = 0
    for i, size in enumerate(sizes):
        r = i % replicas
        old = own[own_off[r] : own_off[r] + size].tolist()
        own_off[r] += size
        new = churn_keys[c_off : c_off + size].tolist()
        c_off += size
        plan.append((names[r], old, new))
    gc.collect()
    removed_n = stored_n = 0
    t0 = _cpu_s()
    for name, old, new in plan:
        removed_n += index.remove(name, old)
        stored_n += index.store(name, new)
    t_churn = _cpu_s() - t0

    match_us: dict[str, float] = {}
    probe_list = probe.tolist()
    for n in MATCH_LENGTHS:
        keys = probe_list[:n]
        result = index.match(keys)
        assert result.blocks.get("r0") == n, (n, dict(result.blocks))
        samples = []
        for _ in range(match_reps):
            # CPU time of this thread: the machine is shared, and time spent descheduled is not
            # the index's cost
            t0 = time.thread_time()
            index.match(keys)
            samples.append(time.thread_time() - t0)
        match_us[str(n)] = float(np.median(samples) * 1e6)
    return {
        "impl": impl,
        "blocks": blocks,
        "replicas": replicas,
        "entries": entries,
        "distinct_keys": distinct,
        "populate_events_per_s": stored / t_pop if t_pop else 0.0,
        "churn_events": removed_n + stored_n,
        "churn_events_per_s": (removed_n + stored_n) / t_churn if t_churn else 0.0,
        "match_us_median": match_us,
        "rss_delta_bytes": rss1 - rss0,
        "bytes_per_entry": (rss1 - rss0) / entries if entries else 0.0,
        "bytes_per_distinct_key": (rss1 - rss0) / distinct if distinct else 0.0,
        "table_bytes": int(index.table_bytes()) if hasattr(index, "table_bytes") else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--replicas", type=int, nargs="+", default=[8, 64])
    p.add_argument("--impl", default="router_policies.prefix_index:PrefixIndex")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--churn-events", type=int, default=400_000)
    p.add_argument("--match-reps", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("bench/results/index.json"))
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        res = run_one(a.blocks[0], a.replicas[0], a.seed, a.impl, a.churn_events, a.match_reps)
        print(json.dumps(res))
        return 0
    rows = []
    for blocks in a.blocks:
        for replicas in a.replicas:
            cmd = [
                sys.executable, "-m", "bench.index_bench", "--one", "--blocks", str(blocks),
                "--replicas", str(replicas), "--impl", a.impl, "--seed", str(a.seed),
                "--churn-events", str(a.churn_events), "--match-reps", str(a.match_reps),
            ]  # fmt: skip
            root = Path(__file__).resolve().parent.parent
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=root).stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows.append(row)
            m = row["match_us_median"]
            print(
                f"blocks={blocks:>11,} replicas={replicas:>3} events/s={row['churn_events_per_s']:>11,.0f} "
                f"populate/s={row['populate_events_per_s']:>11,.0f} match128={m['128']:7.1f}us "
                f"match2048={m['2048']:8.1f}us match8192={m['8192']:8.1f}us "
                f"bytes/entry={row['bytes_per_entry']:6.1f}",
                flush=True,
            )
    write_results(a.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
