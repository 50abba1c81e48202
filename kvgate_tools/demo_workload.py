"""A seeded agent workload rendered as real chat requests, for the live demo and live benchmarks.

Tenants each own a system prompt and a tool schema. Sessions arrive as a Poisson process; each
turn resends the whole transcript (system prompt, every earlier user message and assistant reply)
plus a new user message, after a think-time gap drawn from an exponential distribution. This is
the traffic shape whose prefixes a KV-aware router can reuse: the tenant's head across sessions,
the transcript within a session.

Text is drawn from the committed corpus, so token counts and BPE behaviour are realistic for the
test tokenizer. The same seed always yields the same requests at the same offsets.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parent.parent / "assets" / "corpus" / "stdlib_docstrings.txt"


@dataclass(frozen=True)
class AgentWorkloadSpec:
    tenants: int = 4
    sessions: int = 48
    turns: tuple[int, int] = (3, 7)  # per session, inclusive range
    system_words: int = 700
    tool_words: int = 250
    user_words: tuple[int, int] = (30, 120)  # per user message, inclusive range
    reply_words: int = 40
    session_rate_per_s: float = 4.0  # Poisson arrivals of new sessions
    think_time_mean_s: float = 1.5  # gap between a reply and the next turn
    max_tokens: int = 16
    seed: int = 0


@dataclass(frozen=True)
class Turn:
    think_s: float  # wait after the previous turn's response ended (0 for the first turn)
    body: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class Session:
    """One agent conversation: closed loop, each turn sent after the previous reply and a think time."""

    start_s: float  # offset of the first turn from the start of the replay
    session_id: str
    turns: tuple[Turn, ...]


class WordSource:
    def __init__(self, rng: random.Random, path: Path = CORPUS) -> None:
        text = path.read_text(encoding="utf-8")
        self._words = [w for w in re.split(r"\s+", text) if w]
        self._rng = rng

    def text(self, n: int) -> str:
        start = self._rng.randrange(0, len(self._words) - n - 1)
        return " ".join(self._words[start : start + n])


def _tool(words: WordSource, name: str, n: int) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": words.text(n),
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }


def agent_sessions(model: str, spec: AgentWorkloadSpec) -> list[Session]:
    """Every session of the workload, ordered by start offset."""
    rng = random.Random(spec.seed)
    words = WordSource(rng)
    tenants = [
        (
            f"You are agent {t} of tenant {t}. " + words.text(spec.system_words),
            [_tool(words, f"tool_{t}", spec.tool_words)],
        )
        for t in range(spec.tenants)
    ]
    out: list[Session] = []
    t = 0.0
    for s in range(spec.sessions):
        t += rng.expovariate(spec.session_rate_per_s)
        system, tools = tenants[rng.randrange(spec.tenants)]
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        turns: list[Turn] = []
        for turn in range(rng.randint(*spec.turns)):
            user = words.text(rng.randint(*spec.user_words))
            messages = [*messages, {"role": "user", "content": user}]
            body = {
                "model": model,
                "messages": messages,
                "tools": tools,
                "max_tokens": spec.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            think = 0.0 if turn == 0 else rng.expovariate(1.0 / spec.think_time_mean_s)
            turns.append(Turn(think_s=think, body=body))
            # the next turn carries the reply; a fixed synthetic reply keeps the transcript
            # independent of what the engine generated
            messages = [*messages, {"role": "assistant", "content": words.text(spec.reply_words)}]
        out.append(Session(start_s=t, session_id=f"s{s}", turns=tuple(turns)))
    return out
