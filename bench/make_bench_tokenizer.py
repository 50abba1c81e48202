"""Train the benchmark tokenizer: a ~32k-vocabulary byte-level BPE (docs/performance.md).

The toy 2k tokenizer (``assets/tokenizers/kvgate-tiny``) turns 8 KB of text into ~6k tokens; a
real model's 32k-150k vocabulary yields ~4x fewer, so gateway overhead measured with the toy one
misleads. This script trains offline, deterministically, on local text only: the committed
corpus plus the Python standard library's own sources (``sysconfig``'s stdlib path, tests and
site-packages excluded, files in sorted order), with the same special tokens and ChatML chat
template as kvgate-tiny (read from its ``tokenizer_config.json``).

    .venv/bin/python -m bench.make_bench_tokenizer [--vocab 32000] [--out assets/tokenizers/kvgate-bench-32k]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import tempfile
from pathlib import Path

from kvgate_tools.bpe_tokenizer import train_byte_level_bpe

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "assets/tokenizers/kvgate-tiny"


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in stdlib.rglob("*.py")
        if "site-packages" not in p.parts and not any(part.startswith("test") for part in p.parts)
    )
    return [*sorted((ROOT / "assets/corpus").glob("*.txt")), *files]


def build(vocab: int, out: Path) -> int:
    files = corpus_files()
    with tempfile.TemporaryDirectory() as tmp:
        # one concatenated file: the trainer then sees the text in one fixed order
        joined = Path(tmp) / "corpus.txt"
        with joined.open("w", encoding="utf-8") as f:
            for p in files:
                f.write(p.read_text(encoding="utf-8", errors="replace"))
                f.write("\n")
        size = joined.stat().st_size
        train_byte_level_bpe(vocab, [joined], out)
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", type=Path, default=ROOT / "assets/tokenizers/kvgate-bench-32k")
    args = ap.parse_args()
    size = build(args.vocab, args.out)
    print(f"wrote {args.out} (trained on {size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
