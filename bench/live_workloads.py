"""The live bench's workloads (bench/live.py): what is replayed and on what fleet.

Each workload is a trace of chained block ids (``router_policies.sim.traces``) replayed on a fleet
of ``kvgate sim-engine``s, with what makes placement matter:

* ``agent``: the seeded agent-session workload (``router_policies.sim.workloads.agent_trace``);
* ``mooncake``: ``shared/traces/mooncake_conversation_trace.jsonl``, a window of it per seed
  (``trace_window``);
* ``trace``: any Mooncake-format trace given with ``--trace`` (named by its file), likewise;
* ``kv_pressure``: the agent workload on engines whose KV caches together hold half of its
  working set (each engine ``working set / (2 x replicas)`` blocks), so that what is evicted
  where decides the hit rate;
* ``hetero``: the agent workload on a heterogeneous fleet: every other engine is 3x slower
  (``--time-scale`` x 3), so that a router must see speeds, not only caches and queues;
* ``decode_heavy``: the agent workload with long outputs (256 tokens): decode load, not prefill,
  fills the engines.

Each block id is rendered as a fixed run of words drawn from the local corpus with the id as the
seed, so equal block-id prefixes are equal text prefixes and every router (text-based or
token-based) sees the same prefix structure.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from pathlib import Path

from router_policies.sim.traces import Trace, load_trace
from router_policies.sim.workloads import AgentSpec, agent_trace

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "assets/tokenizers/kvgate-tiny"
MOONCAKE = ROOT.parent / "shared/traces/mooncake_conversation_trace.jsonl"
ENGINE_BLOCK = 16  # tokens per engine KV block


@dataclass(frozen=True, slots=True)
class LiveWorkload:
    name: str
    source: str  # "agent", or a trace file
    words_per_block: int
    max_tokens: int | None = None  # None: --max-tokens
    slowdowns: tuple[float, ...] = (1.0,)  # engine i's time scale x slowdowns[i % len]
    pressure: float = 0.0  # > 0: the fleet's KV cache is the working set / pressure


def workload(name: str, trace: Path) -> LiveWorkload:
    agent = LiveWorkload(name, "agent", 12)
    known = {
        "agent": agent,
        "mooncake": LiveWorkload(name, str(MOONCAKE), 40),
        "kv_pressure": LiveWorkload(name, "agent", 12, pressure=2.0),
        "hetero": LiveWorkload(name, "agent", 12, slowdowns=(1.0, 3.0)),
        "decode_heavy": LiveWorkload(name, "agent", 12, max_tokens=256),
    }
    if name == "trace":
        return LiveWorkload(f"trace:{trace.stem}", str(trace), 40)
    if name not in known:
        raise SystemExit(f"live: unknown workload {name!r} (known: trace, {', '.join(known)})")
    return known[name]


def load(w: LiveWorkload, requests: int, seed: int) -> Trace:
    if w.source == "agent":
        # small enough to replay in minutes; sessions arrive fast so that tenants overlap
        spec = AgentSpec(tenants=8, sessions=max(requests // 6, 4), session_rate_per_s=1.0, gap_median_s=3.0)
        return agent_trace(spec, seed)
    path = Path(w.source)
    if not path.is_file():
        raise SystemExit(f"live: no trace file {path} for the {w.name} workload (give one with --trace)")
    return trace_window(load_trace(path), requests, seed)


def trace_window(trace: Trace, requests: int, seed: int) -> Trace:
    """A trace file's slice for ``seed``: window ``seed mod (len // requests)`` of its consecutive
    ``requests``-request windows (the whole trace when it holds less than two), its arrival times
    counted from the window's first request. So each seed of the live bench replays another part
    of the trace, as each seed of the agent workload draws other sessions; blocks first seen
    before the window are new content to every router alike."""
    windows = len(trace.requests) // requests if requests > 0 else 0
    if windows < 2:
        return trace
    start = (seed % windows) * requests
    part = trace.requests[start : start + requests]
    t0 = part[0].timestamp_ms
    return replace(trace, requests=tuple(replace(r, timestamp_ms=r.timestamp_ms - t0) for r in part))


def render(
    trace: Trace, w: LiveWorkload, requests: int, max_blocks: int, max_tokens: int
) -> list[tuple[float, str, int]]:
    """(arrival s, prompt text, max_tokens) of the first ``requests`` requests."""
    words = sorted(
        set(re.findall(r"[A-Za-z]{3,12}", (ROOT / "assets/corpus/stdlib_docstrings.txt").read_text()))
    )
    k = w.words_per_block
    cache: dict[int, str] = {}
    out = []
    for r in trace.requests[:requests]:
        parts = []
        for bid in r.hash_ids[:max_blocks]:
            text = cache.get(bid)
            if text is None:
                rng = random.Random(bid * 1_000_003 + 17)
                text = cache[bid] = " ".join(rng.choice(words) for _ in range(k)) + ".\n"
            parts.append(text)
        n_out = w.max_tokens or max(1, min(r.output_length, max_tokens))  # fixed when the workload sets it
        out.append((r.timestamp_ms / 1000.0, "".join(parts), n_out))
    t0 = out[0][0] if out else 0.0
    return [(t - t0, p, m) for t, p, m in out]


def pressure_cache_blocks(
    reqs: list[tuple[float, str, int]], w: LiveWorkload, replicas: int
) -> tuple[int, int] | None:
    """(KV blocks per engine, working set in blocks) for ``w``'s pressure (None: no pressure):
    the working set over (pressure x replicas), but room for two of the largest requests at once
    (an engine refuses a request its whole cache cannot hold)."""
    if not w.pressure:
        return None
    working_set, largest = working_set_blocks(reqs)
    return max(2 * largest, int(working_set / (w.pressure * replicas))), working_set


def working_set_blocks(reqs: list[tuple[float, str, int]]) -> tuple[int, int]:
    """The distinct full KV blocks of every prompt (tokenized as the engines do, a block being
    its whole prefix: what the fleet's caches would hold to hit on every shared prefix), and the
    blocks of the largest request (prompt and output)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    seen: set[int] = set()
    largest = 0
    for _t, prompt, max_tokens in reqs:
        ids = tok.encode(prompt).ids
        largest = max(largest, -(-(len(ids) + max_tokens) // ENGINE_BLOCK))
        prefix_hash = 0
        for i in range(len(ids) // ENGINE_BLOCK):
            prefix_hash = hash((prefix_hash, tuple(ids[i * ENGINE_BLOCK : (i + 1) * ENGINE_BLOCK])))
            seen.add(prefix_hash)
    return len(seen), largest
