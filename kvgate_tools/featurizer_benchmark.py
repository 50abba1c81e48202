"""How much the segment cache saves when an agent resends its growing transcript.

    python -m kvgate_tools.featurizer_benchmark [--turns 40] [--vocab 0|32000] [--repeat 3]

Replays one seeded agent conversation turn by turn (each request carries the whole transcript so
far, as agents do) through three featurizers and prints the CPU time per request:
- ``transformers``: apply_chat_template + encode, what the engine does (the reference);
- ``kvgate, no cache``: our renderer and encoder with ``tokenize_cache_entries: 0``;
- ``kvgate, cache``: the same with the segment cache.
Every request's ids are checked equal across the three. ``--vocab N`` first trains a byte-level BPE
of N tokens on the committed corpus (offline, a few seconds) instead of the 2k test tokenizer,
since the figures depend on the vocabulary. Ratios are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets/tokenizers/kvgate-tiny"


def _train(vocab: int, out: Path) -> Path:
    from kvgate_tools.bpe_tokenizer import train_byte_level_bpe

    train_byte_level_bpe(vocab, sorted((ROOT / "assets/corpus").glob("*.txt")), out)
    shutil.copy(TINY / "tokenizer_config.json", out / "tokenizer_config.json")
    return out


def _conversation(turns: int, seed: int) -> list[list[dict[str, Any]]]:
    """The message list of each request of one agent run."""
    rng = random.Random(seed)
    text = (ROOT / "assets/corpus/stdlib_docstrings.txt").read_text(encoding="utf-8")
    paras = [p for p in text.split("\n\n") if 100 < len(p) < 2000]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " + " ".join(rng.sample(paras, 4))},
        {"role": "user", "content": "Fix the failing test. " + rng.choice(paras)},
    ]
    requests = []
    for _ in range(turns):
        requests.append([dict(m) for m in msgs])
        msgs.append({"role": "assistant", "content": rng.choice(paras)})
        msgs.append({"role": "user", "content": "Tool output:\n" + "\n".join(rng.sample(paras, 2))})
    return requests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument(
        "--vocab", type=int, default=0, help="train a BPE of this size (0: the 2k test tokenizer)"
    )
    ap.add_argument("--repeat", type=int, default=3, help="runs per featurizer; the fastest is kept")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers import PreTrainedTokenizerFast

    from gateway.config import ModelConfig
    from gateway.features import EncodeSettings, Featurizer

    with tempfile.TemporaryDirectory() as tmp:
        folder = _train(args.vocab, Path(tmp) / "tok") if args.vocab else TINY
        requests = _conversation(args.turns, args.seed)
        ref: Any = PreTrainedTokenizerFast.from_pretrained(str(folder))

        def run_reference() -> list[list[int]]:
            out = []
            for msgs in requests:
                text = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                out.append(list(ref.encode(text, add_special_tokens=False)))
            return out

        def run_kvgate(entries: int) -> list[list[int]]:
            fz = Featurizer(
                [ModelConfig(name="m", tokenizer=str(folder))],
                EncodeSettings(cache_entries=entries, threads=1),
            )
            out = []
            for msgs in requests:
                _, info = fz.features_sync("chat", {"model": "m", "messages": msgs})
                assert info.token_ids is not None
                out.append(info.token_ids.tolist())
            return out

        timings: dict[str, float] = {}
        results: dict[str, list[list[int]]] = {}
        for name, fn in (
            ("transformers", run_reference),
            ("kvgate, no cache", lambda: run_kvgate(0)),
            ("kvgate, cache", lambda: run_kvgate(4096)),
        ):
            best = float("inf")
            for _ in range(args.repeat):
                t0 = time.process_time()
                results[name] = fn()
                best = min(best, time.process_time() - t0)
            timings[name] = best
        if not results["transformers"] == results["kvgate, no cache"] == results["kvgate, cache"]:
            raise SystemExit("token ids differ between featurizers")
        tokens = sum(len(r) for r in results["transformers"])
        vocab = ref.backend_tokenizer.get_vocab_size() if hasattr(ref, "backend_tokenizer") else len(ref)
        print(
            json.dumps(
                {"requests": len(requests), "vocab": vocab, "mean_prompt_tokens": tokens // len(requests)}
            )
        )
        base = timings["transformers"]
        for name, seconds in timings.items():
            per = seconds / len(requests) * 1e6
            print(f"{name:18s} {per:10.0f} us/request   {base / seconds:6.2f}x transformers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
