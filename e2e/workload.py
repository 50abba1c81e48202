"""Deterministic request workloads for the real-engine checks, built from the committed corpus.

Every random choice draws from a ``random.Random(seed)``; the same seed gives the same requests,
so the kv_aware and round_robin runs of the comparison send byte-identical bodies.

Assistant turns are scripted text rather than the model's own output: the tiny model's output is
random, and an agent that resends its transcript sends what it has, so the scripted transcript is
the realistic and reproducible choice.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "assets/corpus/stdlib_docstrings.txt"
CHARS_PER_TOKEN = 3.2  # rough ratio of the kvgate-tiny BPE on this corpus (sizes need not be exact)


@dataclass(frozen=True)
class Req:
    """One request: ``kind`` is "completion" or "chat"; ``body`` lacks only ``model``."""

    kind: str
    body: dict[str, Any]
    session: str | None = None
    tag: str = ""

    def path(self) -> str:
        return "/v1/completions" if self.kind == "completion" else "/v1/chat/completions"

    def with_model(self, model: str) -> dict[str, Any]:
        return {"model": model, **self.body}


@dataclass
class Corpus:
    paragraphs: list[str]
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    @classmethod
    def load(cls, seed: int, path: Path = CORPUS) -> Corpus:
        text = path.read_text(encoding="utf-8")
        paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]
        return cls(paras, random.Random(seed))

    def text(self, approx_tokens: int) -> str:
        """Consecutive paragraphs from a random start, about ``approx_tokens`` long."""
        want = int(approx_tokens * CHARS_PER_TOKEN)
        i = self.rng.randrange(len(self.paragraphs))
        out: list[str] = []
        size = 0
        while size < want:
            p = self.paragraphs[i % len(self.paragraphs)]
            out.append(p)
            size += len(p) + 2
            i += 1
        return "\n\n".join(out)[:want]


def _gen(max_tokens: int) -> dict[str, Any]:
    # temperature 0 and a fixed seed keep the engine's output (and its KV blocks) reproducible.
    return {"max_tokens": max_tokens, "temperature": 0.0, "seed": 0}


def mixed(seed: int, docs: int = 4, questions: int = 4, sessions: int = 4, turns: int = 4) -> list[Req]:
    """Completions sharing document prefixes, interleaved with multi-turn chats that share a
    system prompt. Sized so that two replicas of 128 blocks must evict."""
    c = Corpus.load(seed)
    out: list[Req] = []
    doc_texts = [c.text(420) for _ in range(docs)]
    completions = [
        Req(
            "completion",
            {"prompt": f"{doc_texts[d]}\n\nQuestion {q}: {c.text(40)}\nAnswer:", **_gen(4)},
            tag=f"doc{d}-q{q}",
        )
        for q in range(questions)
        for d in range(docs)
    ]
    system = "You are a careful assistant for Python's standard library. " + c.text(150)
    chats: list[Req] = []
    transcripts: list[list[dict[str, str]]] = [
        [{"role": "system", "content": system}] for _ in range(sessions)
    ]
    for t in range(turns):
        for s in range(sessions):
            msgs = transcripts[s]
            msgs.append({"role": "user", "content": f"Turn {t}. {c.text(90)}"})
            chats.append(
                Req("chat", {"messages": [dict(m) for m in msgs], **_gen(4)}, f"chat{s}", f"chat{s}-t{t}")
            )
            msgs.append({"role": "assistant", "content": c.text(50)})
    # Interleave: one completion, one chat turn, in order (chat turn t of a session always
    # follows its turn t-1).
    i = j = 0
    while i < len(completions) or j < len(chats):
        if i < len(completions):
            out.append(completions[i])
            i += 1
        if j < len(chats):
            out.append(chats[j])
            j += 1
    return out


def agent_sessions(
    seed: int, sessions: int = 5, turns: int = 6, task_tokens: int = 120, step_tokens: int = 110
) -> list[Req]:
    """Agent sessions: a short shared system prompt, a per-session task, then turns that each add
    a tool result and an assistant step to the transcript the agent resends in full.

    Sessions advance in lockstep (turn t of every session, then turn t+1), the order in which a
    pool of agents hits a gateway. With an odd number of sessions, round_robin places consecutive
    turns of one session on different replicas, as it does in general.
    """
    c = Corpus.load(seed + 1)
    system = "You are a coding agent. Use the tools, then answer briefly."
    transcripts = [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Task {s}: {c.text(task_tokens)}"},
        ]
        for s in range(sessions)
    ]
    out: list[Req] = []
    for t in range(turns):
        for s in range(sessions):
            msgs = transcripts[s]
            out.append(
                Req("chat", {"messages": [dict(m) for m in msgs], **_gen(2)}, f"agent{s}", f"agent{s}-t{t}")
            )
            msgs.append({"role": "assistant", "content": f"Step {t}: calling a tool. {c.text(20)}"})
            msgs.append({"role": "user", "content": f"Tool result {t}:\n{c.text(step_tokens)}"})
    return out


def probes(seed: int, n: int) -> Iterator[Req]:
    """Endless-enough stream of small completions for the restart check (prefixes recur)."""
    c = Corpus.load(seed + 2)
    heads = [c.text(200) for _ in range(3)]
    for i in range(n):
        yield Req("completion", {"prompt": f"{heads[i % 3]}\n#{i}: {c.text(20)}", **_gen(2)}, tag=f"probe{i}")
