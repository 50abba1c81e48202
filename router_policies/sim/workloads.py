"""Seeded workload generators that write the trace format of ``traces.py``.

Three shapes:

* **agent sessions** (``agent_sessions``): tenants each own a system prompt and a tool schema (the
  *head*). Sessions arrive as a Poisson process, each bound to a tenant; every turn resends the
  whole transcript (head, then every earlier user message, assistant reply and tool result) plus a
  new tail: the previous turn's reply and a new tool result (the first turn: a user message). Gaps
  between turns are log-normal (tool execution plus the agent's own latency). The structure is
  content-free: a ``Segment`` is (kind, token count, seed), so the live demo can render the same
  sessions as text and the simulator as synthetic token ids.
* **decode-heavy** (``DECODE_HEAVY``): agent sessions with a reasoning model's long replies.
* **shared-prefix groups** (``group_requests``): G groups x P prompts; every prompt of a group is
  the group's long prefix plus its own suffix, prompts of all groups interleaved at random,
  Poisson arrivals.

Block ids are real chained block keys (``router_policies.block_keys.chain_keys``) of synthetic token
ids drawn from each segment's seed, then renumbered 0, 1, 2, ... in the order they are generated
(session by session, not in the trace's arrival order), so equal prefixes get equal ids and nothing
else does.

Defaults and why (the agent shape follows coding/tool agents: a few thousand tokens of head, then
tool results that dominate the transcript; sessions of about a dozen turns):
  tenants 16, head = system U[500, 1500] + tools U[500, 2000] tokens; sessions 400 arriving at
  0.5/s; turns 1 + geometric (mean 12, at most 40); first user message log-normal (median 300,
  sigma 0.6); tool result per turn log-normal (median 900, sigma 0.9, at most 8,000); reply
  log-normal (median 200, sigma 0.8, 8..2,000); gap between a turn's arrival and the next one
  log-normal (median 15 s, sigma 1.0): the previous reply itself takes ~4 s to stream (~270
  tokens at ~15 ms per decode step on the GPU profile), then the tool runs (a file read takes
  milliseconds, a build or a test run tens of seconds); block size 64.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from router_policies.block_keys import chain_keys, root_key
from router_policies.errors import UserInputError
from router_policies.sim.traces import Trace, TraceRequest


@dataclass(frozen=True, slots=True)
class Segment:
    kind: str  # system | tools | user | assistant | tool_result | prefix | suffix
    tokens: int
    seed: int  # content identity: the same seed always renders the same content


@dataclass(frozen=True, slots=True)
class AgentTurn:
    offset_s: float  # arrival of this turn's request, from the session start
    new_segments: tuple[Segment, ...]  # appended to the transcript just before this request
    output_tokens: int  # this turn's reply; it opens the next turn's new segments


@dataclass(frozen=True, slots=True)
class AgentSession:
    session_id: str
    tenant: int
    start_s: float
    head: tuple[Segment, ...]  # the tenant's system prompt and tool schema
    turns: tuple[AgentTurn, ...]


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A count drawn log-normal (median, sigma), rounded and clamped to ``clamp`` (inclusive)."""

    median: float
    sigma: float
    clamp: tuple[int, int] = (1, 8000)

    def draw(self, rng: random.Random) -> int:
        lo, hi = self.clamp
        return max(lo, min(hi, round(rng.lognormvariate(math.log(self.median), self.sigma))))


@dataclass(frozen=True, slots=True)
class AgentSpec:
    tenants: int = 16
    sessions: int = 400
    session_rate_per_s: float = 0.5
    system_tokens: tuple[int, int] = (500, 1500)
    tool_schema_tokens: tuple[int, int] = (500, 2000)
    mean_turns: float = 12.0
    max_turns: int = 40
    user: LogNormal = LogNormal(300.0, 0.6)  # first user message, tokens
    tool_result: LogNormal = LogNormal(900.0, 0.9)  # tokens, per turn
    reply: LogNormal = LogNormal(200.0, 0.8, (8, 2000))  # tokens, per turn
    gap_median_s: float = 15.0
    gap_sigma: float = 1.0
    block_size: int = 64


@dataclass(frozen=True, slots=True)
class GroupsSpec:
    groups: int = 8
    prompts_per_group: int = 64
    prefix_tokens: int = 6000
    suffix: LogNormal = LogNormal(300.0, 0.7, (1, 20_000))  # tokens
    output: LogNormal = LogNormal(150.0, 0.8, (1, 4000))  # tokens
    rate_per_s: float = 4.0
    block_size: int = 64


def agent_sessions(spec: AgentSpec, seed: int) -> Iterator[AgentSession]:
    """The sessions of the agent workload, in start order; the same (spec, seed) yields the same
    sessions."""
    rng = random.Random(seed)
    heads = []
    for t in range(spec.tenants):
        heads.append(
            (
                Segment("system", rng.randint(*spec.system_tokens), rng.getrandbits(62)),
                Segment("tools", rng.randint(*spec.tool_schema_tokens), rng.getrandbits(62)),
            )
        )
        del t
    start = 0.0
    p_stop = 1.0 / spec.mean_turns
    for s in range(spec.sessions):
        start += rng.expovariate(spec.session_rate_per_s)
        tenant = rng.randrange(spec.tenants)
        n_turns = 1
        while n_turns < spec.max_turns and rng.random() > p_stop:
            n_turns += 1
        turns: list[AgentTurn] = []
        offset = 0.0
        prev_reply: Segment | None = None
        for k in range(n_turns):
            if k == 0:
                new: tuple[Segment, ...] = (Segment("user", spec.user.draw(rng), rng.getrandbits(62)),)
            else:
                offset += rng.lognormvariate(math.log(spec.gap_median_s), spec.gap_sigma)
                assert prev_reply is not None
                tool = Segment("tool_result", spec.tool_result.draw(rng), rng.getrandbits(62))
                new = (prev_reply, tool)
            out = spec.reply.draw(rng)
            turns.append(AgentTurn(offset_s=offset, new_segments=new, output_tokens=out))
            prev_reply = Segment("assistant", out, rng.getrandbits(62))
        yield AgentSession(f"s{s}", tenant, start, heads[tenant], tuple(turns))


def segment_tokens(seg: Segment) -> np.ndarray:
    """Synthetic token ids of a segment (deterministic in its seed)."""
    return np.random.default_rng(seg.seed).integers(0, 1 << 31, size=seg.tokens, dtype=np.int64)


@dataclass(slots=True)
class _Renumber:
    """Block key -> small int, in order of first appearance (shared by one trace's prompts)."""

    ids: dict[int, int] = field(default_factory=dict)

    def extend(self, keys: Sequence[int], out: list[int]) -> None:
        ids = self.ids
        for k in keys:
            v = ids.get(k)
            if v is None:
                v = ids[k] = len(ids)
            out.append(v)


class _Prompt:
    """A growing token sequence with the ids of its full blocks (chained keys, renumbered),
    computed incrementally: extending a prompt keys only its new blocks."""

    def __init__(self, root: int, block_size: int, renumber: _Renumber) -> None:
        self.root = root
        self.bs = block_size
        self.renumber = renumber
        self.length = 0
        self.last_key = root
        self.ids: list[int] = []
        self._pending = np.zeros(0, dtype=np.int64)  # tokens after the last full block

    def copy(self) -> _Prompt:
        p = _Prompt(self.root, self.bs, self.renumber)
        p.length = self.length
        p.last_key = self.last_key
        p.ids = list(self.ids)
        p._pending = self._pending
        return p

    def extend(self, tokens: np.ndarray) -> None:
        buf = np.concatenate([self._pending, tokens])
        full = len(buf) // self.bs
        if full:
            keys = chain_keys(self.last_key, buf[: full * self.bs], self.bs)
            self.last_key = keys[-1]
            self.renumber.extend(keys, self.ids)
        self._pending = buf[full * self.bs :]
        self.length += len(tokens)


def agent_trace(spec: AgentSpec, seed: int, name: str = "agent") -> Trace:
    root = root_key("agent-workload")
    renumber = _Renumber()
    heads: dict[int, _Prompt] = {}
    rows: list[tuple[float, int, int, TraceRequest]] = []
    for order, sess in enumerate(agent_sessions(spec, seed)):
        if sess.tenant not in heads:
            hp = _Prompt(root, spec.block_size, renumber)
            for seg in sess.head:
                hp.extend(segment_tokens(seg))
            heads[sess.tenant] = hp
        prompt = heads[sess.tenant].copy()
        for k, turn in enumerate(sess.turns):
            for seg in turn.new_segments:
                prompt.extend(segment_tokens(seg))
            t_ms = (sess.start_s + turn.offset_s) * 1000.0
            rows.append(
                (
                    t_ms,
                    order,
                    k,
                    TraceRequest(t_ms, prompt.length, turn.output_tokens, tuple(prompt.ids), sess.session_id),
                )
            )
    return _finish(name, spec.block_size, rows)


def group_requests(spec: GroupsSpec, seed: int) -> Trace:
    rng = random.Random(seed)
    root = root_key("groups-workload")
    renumber = _Renumber()
    prefixes = []
    for _g in range(spec.groups):
        p = _Prompt(root, spec.block_size, renumber)
        p.extend(segment_tokens(Segment("prefix", spec.prefix_tokens, rng.getrandbits(62))))
        prefixes.append(p)
    order = [g for g in range(spec.groups) for _ in range(spec.prompts_per_group)]
    rng.shuffle(order)
    t = 0.0
    rows: list[tuple[float, int, int, TraceRequest]] = []
    for i, g in enumerate(order):
        t += rng.expovariate(spec.rate_per_s)
        p = prefixes[g].copy()
        n = spec.suffix.draw(rng)
        p.extend(segment_tokens(Segment("suffix", n, rng.getrandbits(62))))
        out = spec.output.draw(rng)
        t_ms = t * 1000.0
        rows.append((t_ms, i, 0, TraceRequest(t_ms, p.length, out, tuple(p.ids), f"g{g}")))
    return _finish("groups", spec.block_size, rows)


def _finish(name: str, block_size: int, rows: list[tuple[float, int, int, TraceRequest]]) -> Trace:
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    out = []
    for _t, _o, _k, r in rows:
        # millisecond timestamps, as in the Mooncake files (and so that JSON round-trips exactly)
        ts = float(round(r.timestamp_ms))
        out.append(TraceRequest(ts, r.input_length, r.output_length, r.hash_ids, r.session_id))
    return Trace(name=name, block_size=block_size, requests=tuple(out))


# decode-heavy: the agent shape with the long replies of a reasoning model (thinking tokens
# included: median 1,200, up to 8,000) and short tool results, so that decoding, not prefill,
# takes most of the engines' time (65 % of the no-cache service time on llama3-8b-h100, against
# 26 % for "agent"; seed 0: 3,787 requests, prompts mean 24.4k tokens); turns wait for the previous reply to stream (1,200 tokens at ~15 ms: ~18 s), hence
# a longer gap (median 40 s)
DECODE_HEAVY = AgentSpec(
    sessions=300,
    tool_result=LogNormal(300.0, 0.9),
    reply=LogNormal(1200.0, 0.7, (64, 8000)),
    gap_median_s=40.0,
)

WORKLOADS = ("agent", "groups", "decode-heavy")


def generate(kind: str, seed: int) -> Trace:
    if kind == "agent":
        return agent_trace(AgentSpec(), seed)
    if kind == "groups":
        return group_requests(GroupsSpec(), seed)
    if kind == "decode-heavy":
        return agent_trace(DECODE_HEAVY, seed, name="decode-heavy")
    raise UserInputError(f"--workload: unknown workload {kind!r} (known: {', '.join(WORKLOADS)})")
