"""Two routers' runs of the same live replay, request by request (``bench/live.py`` writes each
run's ``requests.jsonl`` into its folder, ``<out dir>/tmp/live/<workload>-<router>-<seed>``).

A pooled hit rate or p99 says how two routers compare, not which requests make the difference.
On a trace of little reuse the engine-counted hit rate is made by a handful of requests, and a
p99 by 1 % of them (docs/performance.md, "The synthetic trace's hit rate, request by request"
and "RAG's slowest first tokens, request by request"). Both runs replay the same requests in the
same order (the same workload and seed), so the i-th record of one is the same request as the
i-th of the other. This prints:

* each run's requests served with cached prompt tokens, and their tokens;
* the requests whose cached tokens differ between the runs, each run's figures beside the other's;
* each run's slowest ``--slowest`` fraction by client TTFT, beside the same request in the other.

    .venv/bin/python -m bench.live_requests RUN_A RUN_B [--slowest 0.01]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.live_hop import REQUESTS_FILE

Record = dict[str, Any]


def read_requests(run: Path) -> list[Record]:
    """A run folder's records (or the records file itself), in request order."""
    path = run / REQUESTS_FILE if run.is_dir() else run
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _fig(r: Record) -> str:
    def ms(key: str) -> str:
        v = r.get(key)
        return "-" if v is None else f"{v:.1f}"

    engine = "-" if r.get("engine") is None else f"e{r['engine']}"
    cached = "-" if r.get("cached") is None else str(r["cached"])
    return (
        f"{engine} cached {cached:>6} ttft {ms('ttft_ms'):>7} (in {ms('inbound_ms')}, "
        f"parse {ms('engine_parse_ms')}, engine {ms('engine_first_token_ms')}, out {ms('outbound_ms')})"
    )


def compare(a: Sequence[Record], b: Sequence[Record], names: tuple[str, str], slowest: float) -> list[str]:
    """The lines the command prints for runs ``a`` and ``b`` (named ``names``)."""
    if len(a) != len(b) or any(x["key"] != y["key"] for x, y in zip(a, b, strict=True)):
        raise ValueError("the two runs did not replay the same requests in the same order")
    lines = []
    for name, run in zip(names, (a, b), strict=True):
        hits = [r for r in run if r.get("cached")]
        lines.append(
            f"{name}: {len(hits)} of {len(run)} requests with cached prompt tokens, "
            f"{sum(r['cached'] for r in hits)} tokens"
        )
    differ = [
        i
        for i, (x, y) in enumerate(zip(a, b, strict=True))
        if (x.get("cached") or 0) != (y.get("cached") or 0)
    ]
    lines.append(f"cached tokens differ on {len(differ)} requests:")
    lines += [f"  #{i:<5} {names[0]}: {_fig(a[i])} | {names[1]}: {_fig(b[i])}" for i in differ]
    n = max(1, math.ceil(slowest * len(a))) if a else 0
    for name, mine, other, other_name in ((names[0], a, b, names[1]), (names[1], b, a, names[0])):
        timed = sorted((r for r in mine if r.get("ttft_ms") is not None), key=lambda r: r["ttft_ms"])
        lines.append(f"{name}'s slowest {n} by client TTFT, beside {other_name}'s:")
        lines += [f"  #{r['i']:<5} {_fig(r)} | {_fig(other[r['i']])}" for r in reversed(timed[-n:])]
    return lines


def _shared_head(a: str, b: str) -> str:
    """The leading part of two run folders' names up to the last "-" both have there."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[: a.rfind("-", 0, n) + 1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs=2, type=Path, help="two run folders (or their requests.jsonl)")
    ap.add_argument("--slowest", type=float, default=0.01, help="the fraction of each run's slowest shown")
    args = ap.parse_args(argv)
    a, b = (read_requests(p) for p in args.runs)
    name_a, name_b = (p.name if p.is_dir() else p.parent.name for p in args.runs)
    common = _shared_head(name_a, name_b)  # the workload's part: named once, in the header
    if common:
        print(f"{common}*:")
        name_a, name_b = name_a[len(common) :], name_b[len(common) :]
    for line in compare(a, b, (name_a, name_b), args.slowest):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
