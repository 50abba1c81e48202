"""The values the replica model takes and returns (router_policies/sim/replica_model.py holds the
contract and docs/architecture.md the design): engine settings and step costs, requests, KV events,
step results and metrics, and the engine's per-request state."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, fields

RequestId = Hashable


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Seconds per step and per unit of work (see the module docstring for the formula)."""

    step_overhead_s: float
    prefill_s_per_token: float
    prefill_s_per_token_ctx: float = 0.0
    decode_s_per_seq: float = 0.0
    decode_s_per_ctx_token: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):  # every cost is a duration
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name}: must be >= 0")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_blocks: int
    block_size: int
    costs: StepCosts
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: RequestId
    block_ids: Sequence[int]  # one per full prompt block, chained ids
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_ids: tuple[int, ...]  # consecutive blocks, each the child of the previous one
    parent: int | None  # id of the block before the first one, None for a first block


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class FirstToken:
    request_id: RequestId
    cached_tokens: int  # prefix hit at the request's first admission, in tokens


@dataclass(slots=True)
class StepResult:
    start: float
    end: float
    steps: int = 1
    prefill_tokens: int = 0
    first_tokens: list[FirstToken] = field(default_factory=list)
    decoded: list[tuple[RequestId, int]] = field(default_factory=list)
    finished: list[RequestId] = field(default_factory=list)
    preempted: list[RequestId] = field(default_factory=list)
    events: list[KvEvent] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    running: int
    waiting: int
    kv_usage: float
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found cached


class RequestTooLargeError(ValueError):
    """The request cannot fit in the KV cache even alone."""


class ReqState:
    """One request inside the engine (waiting or running)."""

    __slots__ = (
        "cached_tokens",
        "computed",
        "ids",
        "kv_cap",
        "n_ids",
        "out_max",
        "outputs",
        "phys",
        "prompt",
        "req",
        "rid",
        "stored",
        "target",
    )

    def __init__(self, req: EngineRequest) -> None:
        self.req = req
        self.rid = req.request_id
        self.prompt = req.prompt_tokens
        self.out_max = req.output_tokens
        self.ids = req.block_ids
        self.n_ids = len(req.block_ids)
        self.kv_cap = 0  # tokens the held blocks can take: len(phys) x block_size
        self.target = req.prompt_tokens  # tokens to prefill (prompt + generated after a preemption)
        self.computed = 0  # of target, including the cached prefix
        self.outputs = 0  # tokens emitted so far
        self.cached_tokens = -1  # set at first admission
        self.stored = 0  # leading prompt blocks whose caching has been decided
        self.phys: list[int] = []
