"""Held-out Mooncake-format traces of the families issue 11 names (docs/performance.md, "Prefix
checkpoints"), for ``python -m bench.live --trace FILE``: none of them is a workload the bench or
the simulator tunes on.

* ``rag``: 40 documents of 3-16 blocks drawn Zipf(1.1); a quarter of the requests carry a second
  document after the first; each ends with one new query block; Poisson arrivals at 4 req/s.
* ``agents``: four shared system prompts of 2-6 blocks; sessions (0.6 a second) of 3-25 turns,
  each resending its transcript plus 1-5 new blocks, turns lognormal(1.0, 0.8) seconds apart.
* ``mixed``: 750 of each (half the rates), merged by arrival.

Block ids are prefix ids as in the Mooncake files (the same id at position i means the same first
i + 1 blocks), 512 tokens a block; output lengths lognormal around 150 / 300 / 200 tokens.
Deterministic: the same seed writes the same files.

    .venv/bin/python -m bench.heldout_traces --out out/traces --seed 42
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

BLOCK = 512
Rows = list[tuple[float, list[int]]]  # (arrival s, raw block ids: equal lists = equal prefixes)
Drawn = tuple[Rows, random.Random]  # and the generator, which then draws the lengths


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def new(self, k: int) -> list[int]:
        out = list(range(self.next, self.next + k))
        self.next += k
        return out


def rag(seed: int, n: int = 1500, rate: float = 4.0) -> Drawn:
    rng, ids = random.Random(seed), _Ids()
    docs = [ids.new(rng.randint(3, 16)) for _ in range(40)]
    weights = [1 / (i + 1) ** 1.1 for i in range(len(docs))]
    t, rows = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        blocks = list(docs[rng.choices(range(len(docs)), weights)[0]])
        if rng.random() < 0.25:  # a second document: new content after this first one
            blocks += docs[rng.choices(range(len(docs)), weights)[0]]
        rows.append((t, blocks + ids.new(1)))
    return rows, rng


def agents(seed: int, n: int = 1500, session_rate: float = 0.6) -> Drawn:
    rng, ids = random.Random(seed), _Ids()
    systems = [ids.new(rng.randint(2, 6)) for _ in range(4)]
    rows: Rows = []
    start = 0.0
    while len(rows) < n:
        start += rng.expovariate(session_rate)
        blocks, t = list(systems[rng.randrange(4)]) + ids.new(1), start
        for _turn in range(rng.randint(3, 25)):
            rows.append((t, list(blocks)))
            blocks += ids.new(rng.choice([1, 1, 1, 2, 2, 3, 5]))
            t += rng.lognormvariate(1.0, 0.8)
    rows.sort(key=lambda r: r[0])
    return rows[:n], rng


def mixed(seed: int) -> Drawn:
    apart = [(t, [b + 10**7 for b in blocks]) for t, blocks in rag(seed + 1, 750, 2.0)[0]]
    return sorted(apart + agents(seed + 1, 750, 0.3)[0], key=lambda r: r[0]), random.Random(seed)


def lines(rows: Rows, rng: random.Random, out_median: int) -> list[str]:
    """Mooncake JSON lines: prefix ids (a block's id stands for all blocks up to it)."""
    seen: dict[tuple[int, ...], int] = {}
    out = []
    for t, blocks in rows:
        hash_ids = [seen.setdefault(tuple(blocks[: i + 1]), len(seen)) for i in range(len(blocks))]
        doc = {
            "timestamp": int(t * 1000),
            "input_length": len(blocks) * BLOCK - rng.randint(0, BLOCK - 1),
            "output_length": max(1, int(rng.lognormvariate(0, 0.8) * out_median)),
            "hash_ids": hash_ids,
        }
        out.append(json.dumps(doc))
    return out


def write(out: Path, seed: int) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for name, (rows, rng), median in (
        ("rag", rag(seed), 150),
        ("agents", agents(seed), 300),
        ("mixed", mixed(seed), 200),
    ):
        path = out / f"{name}_{seed}.jsonl"
        path.write_text("\n".join(lines(rows, rng, median)) + "\n")
        made.append(path)
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("out/traces"))
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args(argv)
    for path in write(args.out, args.seed):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
