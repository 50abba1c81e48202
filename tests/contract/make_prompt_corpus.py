"""Generate the committed prompt corpus the token contract tests replay (deterministic, seeded).

    python tests/contract/make_prompt_corpus.py [--out tests/contract/prompt_corpus.jsonl]

Each line is ``{"id", "kind": "chat" | "completions", "body": {...}}``: request bodies as clients
send them to ``/v1/chat/completions`` and ``/v1/completions``. The mix covers system prompts,
multi-turn and long agent transcripts, tools, unicode (CJK, emoji, combining marks, RTL, zero-width),
whitespace at segment edges, empty and null content, content given as lists of text parts,
special-token text inside user content, and completions given as text or token ids.

Only request features that vLLM and a plain ``transformers`` reference treat the same way are
used here (canonical tool objects, no ``continue_final_message``); the unit tests cover the rest.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODEL = "kvgate-tiny"
SEED = 20261129

UNICODE_SNIPPETS = [
    "naïve café — déjà vu",
    "前缀缓存让推理引擎复用已经计算过的注意力键值。",
    "プレフィックスキャッシュ",
    "접두사 캐시는 반복되는 요청을 빠르게 합니다",
    "emoji 🚀🔥👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "combining e\u0301 a\u0308 o\u0303",
    "RTL: مرحبا بالعالم שלום עולם",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "math ∑∫√∞ ≤ ≥ ≠ → ⇒",
    "tabs\tand\r\nwindows newlines",
    "Ελληνικά και русский текст",
    "",
]
SPECIAL_TEXT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nfake<|im_end|>"]
EDGE_WS = ["", " ", "  ", "\n", "\n\n", "\t", " \n ", "   \n"]


def _paragraphs() -> list[str]:
    text = (ROOT / "assets/corpus/stdlib_docstrings.txt").read_text(encoding="utf-8")
    paras = [p.strip() for p in text.split("\n\n") if 40 <= len(p.strip()) <= 1500]
    multi = (ROOT / "assets/corpus/multilingual.txt").read_text(encoding="utf-8").splitlines()
    return paras + [m for m in multi if m.strip()]


def _tool(rng: random.Random, i: int) -> dict[str, Any]:
    props = {
        f"arg{j}": {"type": rng.choice(["string", "integer", "boolean"]), "description": f"argument {j} — ü"}
        for j in range(rng.randint(0, 3))
    }
    return {
        "type": "function",
        "function": {
            "name": f"tool_{i}_{rng.randint(0, 999)}",
            "description": rng.choice(["Look something up.", "Run a shell command", "检索文档", ""]),
            "parameters": {"type": "object", "properties": props, "required": sorted(props)[:1]},
        },
    }


class Gen:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.paras = _paragraphs()

    def text(self, lo: int = 1, hi: int = 3) -> str:
        rng = self.rng
        pieces = [rng.choice(self.paras) for _ in range(rng.randint(lo, hi))]
        if rng.random() < 0.3:
            pieces.insert(rng.randint(0, len(pieces)), rng.choice(UNICODE_SNIPPETS))
        sep = rng.choice(["\n\n", "\n", " "])
        return rng.choice(EDGE_WS) + sep.join(pieces) + rng.choice(EDGE_WS)

    def content(self) -> Any:
        rng = self.rng
        r = rng.random()
        if r < 0.65:
            return self.text()
        if r < 0.85:
            return [{"type": "text", "text": self.text(1, 1)} for _ in range(rng.randint(1, 3))]
        if r < 0.92:
            return ""
        return rng.choice(UNICODE_SNIPPETS)

    def conversation(self, turns: int, system: bool) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = []
        if system:
            msgs.append({"role": "system", "content": "You are a careful assistant. " + self.text(0, 1)})
        for t in range(turns):
            msgs.append({"role": "user", "content": self.content()})
            if t < turns - 1:
                msgs.append({"role": "assistant", "content": self.content()})
        return msgs


def build(seed: int) -> list[dict[str, Any]]:
    g = Gen(seed)
    rng = g.rng
    items: list[dict[str, Any]] = []

    def add(kind: str, body: dict[str, Any], label: str) -> None:
        items.append({"id": f"{len(items):03d}-{label}", "kind": kind, "body": {"model": MODEL, **body}})

    for _ in range(30):  # single turn, with and without a system prompt
        add("chat", {"messages": g.conversation(1, rng.random() < 0.5)}, "single")
    for _ in range(30):  # multi-turn
        add("chat", {"messages": g.conversation(rng.randint(2, 6), rng.random() < 0.7)}, "multi")
    for _ in range(12):  # long agent transcripts (what a resent transcript looks like)
        add("chat", {"messages": g.conversation(rng.randint(12, 24), True)}, "long")
    for _ in range(25):  # tools
        tools = [_tool(rng, i) for i in range(rng.randint(1, 4))]
        add(
            "chat",
            {"messages": g.conversation(rng.randint(1, 3), rng.random() < 0.6), "tools": tools},
            "tools",
        )
    for _ in range(12):  # null content and tool messages
        msgs = g.conversation(rng.randint(1, 3), True)
        msgs.insert(-1, {"role": "assistant", "content": None})
        msgs.insert(
            -1, {"role": "tool", "content": g.text(1, 1), "tool_call_id": f"call_{rng.randint(0, 99)}"}
        )
        add("chat", {"messages": msgs}, "nullcontent")
    for _ in range(10):  # special-token text inside content
        msgs = g.conversation(rng.randint(1, 2), rng.random() < 0.5)
        msgs[-1]["content"] = g.text(0, 1) + rng.choice(SPECIAL_TEXT) + g.text(0, 1)
        add("chat", {"messages": msgs}, "specialtext")
    for _ in range(12):  # no generation prompt
        add(
            "chat",
            {"messages": g.conversation(rng.randint(1, 4), True), "add_generation_prompt": False},
            "nogen",
        )
    for _ in range(8):  # unicode-only messages
        msgs = [{"role": "user", "content": "".join(rng.sample(UNICODE_SNIPPETS, 4))}]
        add("chat", {"messages": msgs}, "unicode")
    for _ in range(6):  # whitespace-only and empty content
        msgs = [
            {"role": "system", "content": rng.choice(EDGE_WS)},
            {"role": "user", "content": rng.choice(EDGE_WS)},
        ]
        add("chat", {"messages": msgs}, "whitespace")

    for _ in range(40):  # completions on text
        prompt = g.text(1, 4)
        if rng.random() < 0.2:
            prompt += rng.choice(SPECIAL_TEXT) + g.text(0, 1)
        add("completions", {"prompt": prompt}, "text")
    for _ in range(8):
        add("completions", {"prompt": rng.choice(UNICODE_SNIPPETS[:-1]) * rng.randint(1, 5)}, "unicode")
    for _ in range(6):
        add("completions", {"prompt": [rng.randint(3, 2047) for _ in range(rng.randint(1, 200))]}, "ids")
    for _ in range(6):
        add("completions", {"prompt": [g.text(1, 2)]}, "batch1")
    for _ in range(5):
        long_prompt = "\n\n".join(g.text(3, 3) for _ in range(6))
        add("completions", {"prompt": long_prompt}, "long")
    return items


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "prompt_corpus.jsonl")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    items = build(args.seed)
    with args.out.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    print(f"wrote {len(items)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
