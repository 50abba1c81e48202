"""A vLLM-like serving engine at block level: one model of a replica, used offline (the
discrete-event simulator) and live (the simulated engine drives it in real time).

API (stable; ``replica_agent``'s simulated engine builds on it)::

    model = ReplicaModel(EngineConfig(num_blocks=C, block_size=B, costs=StepCosts(...)))
    model.submit(EngineRequest(request_id, block_ids, prompt_tokens, output_tokens), now)
    t = model.next_step_time()        # None when idle, else the earliest start of the next step
    res = model.step(t)               # run exactly one engine step starting at t
    res = model.step(t, horizon=h)    # offline: also merge the run of identical decode-only steps
                                      # that start before h (see "Fast-forward")
    res.end                           # when the step's tokens are out; the engine is busy until then
    res.first_tokens                  # [FirstToken(request_id, cached_tokens)]: prefill done
    res.decoded                       # [(request_id, n)]: n decode tokens emitted (n = res.steps)
    res.finished                      # [request_id], the requests whose last token came out
    res.events                        # [BlockStored | BlockRemoved | AllBlocksCleared], in order
    model.metrics()                   # EngineMetrics: running, waiting, kv_usage, prefix counters
    model.clear()                     # reset the prefix cache (False while blocks are pinned)
    model.abort(request_id)           # drop a waiting/running request (client gone); False if unknown

``step(t)`` applies the step's state changes at once and reports when its outputs exist
(``res.end``); the caller treats tokens and KV events as happening at ``res.end`` and calls
``step`` again no earlier than ``next_step_time()`` (which is ``res.end`` while work remains).
A request submitted while a step runs joins the next step.

Block identity
    ``block_ids`` are opaque ints chosen by the caller, one per *full* prompt block, in order, and
    chained: id i stands for the whole prefix of blocks 0..i (Mooncake ``hash_ids`` offline, the
    engine's own block hashes live). ``len(block_ids)`` must equal ``prompt_tokens // block_size``;
    a trailing partial block is allocated but never cached, as in vLLM. Blocks filled by generated
    tokens are allocated but not cached either (the caller has no ids for them).

KV cache (vLLM v1 ``BlockPool`` semantics)
    ``num_blocks`` physical blocks. Every block with reference count 0 sits in one free queue,
    initially in index order; allocation pops from its front, and a popped block that still holds
    a cached id is evicted (``BlockRemoved``). A finished or preempted request returns its blocks
    to the back of the queue in *reverse* order, so its tail is evicted before its head. A prefix
    hit on a free cached block takes it out of the queue (reference count 1 -> pinned). Hence
    eviction is least-recently-freed first, and blocks of running requests are never evicted.
    A full prompt block becomes cached (``BlockStored`` with its parent id) in the step that
    computes its last token. If the same id is already cached (two requests computed one prefix
    concurrently) the second copy stays uncached, so that the cached set is exactly a set of ids and
    replaying the events reproduces it (vLLM keeps both copies and reports the store twice).

Scheduling (vLLM v1 scheduler, FCFS)
    Each step has a token budget ``max_num_batched_tokens``. Running requests are scheduled first,
    in admission order: a decoding request takes 1 token (allocating a block when its KV crosses a
    block boundary), a prefilling one takes a chunk ``min(remaining, budget left)`` (chunked
    prefill). When a decode block cannot be allocated the most recently admitted running request is
    preempted (recompute mode: its blocks are freed, it goes back to the front of the waiting queue,
    and later re-prefills prompt + generated tokens). Waiting requests are admitted in order,
    only in steps without preemption, while fewer than ``max_num_seqs`` run and budget remains, and
    only if the free queue can supply the blocks of the whole prompt beyond its cached prefix (the
    head waits otherwise; no request jumps it). At admission the cached prefix is the longest run
    of leading block ids in the cache, capped so that at least one prompt token is computed (vLLM
    recomputes the last token of a fully cached prompt). A request's first token comes out at the
    end of the step that computes its last prompt token; every later step emits one more token.
    Simplification: vLLM allocates a prefilling request's blocks chunk by chunk; this model
    allocates the whole prompt at admission, so a request never stalls half-way through prefill.

Step cost (seconds), with n_i the prompt tokens computed for request i from context position c_i,
and L_j the KV length of decoding request j after the step::

    overhead + prefill_per_token x sum n_i + prefill_per_token_ctx x sum (n_i c_i + n_i (n_i + 1) / 2)
             + decode_per_seq x (#decoding) + decode_per_ctx_token x sum L_j

(a linear term for weights and MLPs, a causal-attention term, and the KV reads of decoding).

Fast-forward
    When a step schedules only decode tokens (no admission, prefill, allocation, preemption,
    completion or event) the following steps are the same step with every KV one token longer,
    until a request finishes, crosses a block boundary, or a new request arrives. With a
    ``horizon`` (the next arrival anywhere) ``step`` merges those k steps into one result in closed
    form: step j lasts ``D + j g`` (g = decode_per_ctx_token x #decoding), so the run ends at
    ``t + k D + g k (k - 1) / 2``. Merged steps start before the horizon and never include a
    completion or allocation; the state observed at any arrival is therefore what step-by-step
    execution would show (token counters aside). Same model, same arithmetic.

Counters (as vLLM's /metrics): running, waiting, kv_usage = pinned blocks / num_blocks,
prefix_cache_queries / prefix_cache_hits in tokens, counted once per admission.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

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
        for name in (
            "step_overhead_s",
            "prefill_s_per_token",
            "prefill_s_per_token_ctx",
            "decode_s_per_seq",
            "decode_s_per_ctx_token",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")


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


class _Req:
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


class ReplicaModel:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        n = config.num_blocks
        self._hash: list[int | None] = [None] * n  # physical block -> cached id
        self._ref: list[int] = [0] * n
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(n))  # front = evict first
        self._cached: dict[int, int] = {}  # id -> physical block
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []  # admission order
        self._busy_until = float("-inf")
        self._last_submit = float("-inf")
        self._pending_events: list[KvEvent] = []
        self._queries = 0
        self._hits = 0

    # ------------------------------------------------------------------ inputs
    def submit(self, req: EngineRequest, now: float) -> None:
        cfg = self.config
        if req.prompt_tokens <= 0 or req.output_tokens <= 0:
            raise ValueError("prompt_tokens and output_tokens must be > 0")
        if len(req.block_ids) != req.prompt_tokens // cfg.block_size:
            raise ValueError(
                f"request {req.request_id!r}: {len(req.block_ids)} block ids for "
                f"{req.prompt_tokens} tokens of block size {cfg.block_size}"
            )
        need = -(-(req.prompt_tokens + req.output_tokens) // cfg.block_size)
        if need > cfg.num_blocks:
            raise RequestTooLargeError(
                f"request {req.request_id!r} needs {need} blocks, the cache has {cfg.num_blocks}"
            )
        self._waiting.append(_Req(req))
        self._last_submit = max(self._last_submit, now)

    def clear(self) -> bool:
        """vLLM's reset_prefix_cache: forget every cached id. Refused (False) while any block is
        pinned by a request. The ``AllBlocksCleared`` event comes with the next step."""
        if len(self._free) != self.config.num_blocks:
            return False
        for phys in self._cached.values():
            self._hash[phys] = None
        self._cached.clear()
        self._pending_events.append(AllBlocksCleared())
        return True

    def abort(self, request_id: RequestId) -> bool:
        """vLLM's abort (the client went away): drop a waiting or running request between steps.
        Its blocks are released like a finished request's (cached ones stay cached, no event).
        False when the request is not in the engine."""
        for i, r in enumerate(self._running):
            if r.req.request_id == request_id:
                del self._running[i]
                self._release(r)
                return True
        for r in self._waiting:
            if r.req.request_id == request_id:
                self._waiting.remove(r)
                self._release(r)  # no-op unless it holds blocks
                return True
        return False

    # ------------------------------------------------------------------ queries
    def next_step_time(self) -> float | None:
        if self._running:
            return self._busy_until
        if self._waiting:
            return max(self._busy_until, self._last_submit)
        return None

    def metrics(self) -> EngineMetrics:
        n = self.config.num_blocks
        return EngineMetrics(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_usage=(n - len(self._free)) / n,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    def load(self) -> tuple[int, int, float]:
        """(running, waiting, kv_usage) without building an ``EngineMetrics``."""
        n = self.config.num_blocks
        return len(self._running), len(self._waiting), (n - len(self._free)) / n

    @property
    def busy_until(self) -> float:
        return self._busy_until

    def cached_ids(self) -> set[int]:
        return set(self._cached)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._cached

    def free_blocks(self) -> int:
        return len(self._free)

    # ------------------------------------------------------------------ blocks
    def _allocate(self, k: int, events: list[KvEvent], out: list[int]) -> bool:
        """Pop ``k`` blocks from the front of the free queue into ``out`` (evicting their cached ids,
        reported as one BlockRemoved). False, with nothing changed, when fewer than ``k`` are free."""
        free = self._free
        if k > len(free):
            return False
        hashes = self._hash
        ref = self._ref
        cached = self._cached
        removed: list[int] = []
        for _ in range(k):
            phys, _none = free.popitem(last=False)
            old = hashes[phys]
            if old is not None:
                del cached[old]
                hashes[phys] = None
                removed.append(old)
            ref[phys] = 1
            out.append(phys)
        if removed:
            if events and isinstance(events[-1], BlockRemoved):
                events[-1] = BlockRemoved((*events[-1].block_ids, *removed))
            else:
                events.append(BlockRemoved(tuple(removed)))
        return True

    def _release(self, r: _Req) -> None:
        ref = self._ref
        free = self._free
        for phys in reversed(r.phys):
            ref[phys] -= 1
            if ref[phys] == 0:
                free[phys] = None
        r.phys = []
        r.kv_cap = 0

    def _admit(self, r: _Req, events: list[KvEvent]) -> bool:
        """Admit ``r`` if the free queue can supply its blocks; False leaves everything unchanged."""
        bs = self.config.block_size
        cached = self._cached
        ref = self._ref
        ids = r.ids
        cap = min(r.n_ids, (r.target - 1) // bs)
        hits: list[int] = []
        for i in range(cap):
            phys = cached.get(ids[i])
            if phys is None:
                break
            hits.append(phys)
        n_hits = len(hits)
        need = -(-r.target // bs) - n_hits
        in_free = sum(1 for p in hits if ref[p] == 0)
        if need > len(self._free) - in_free:
            return False
        free = self._free
        for p in hits:
            if ref[p] == 0:
                del free[p]
            ref[p] += 1
        self._allocate(need, events, hits)  # checked above: cannot fail
        r.phys = hits
        r.kv_cap = len(hits) * bs
        r.computed = n_hits * bs
        r.stored = n_hits
        if r.cached_tokens < 0:
            r.cached_tokens = r.computed
        self._queries += r.prompt
        self._hits += n_hits * bs
        return True

    def _store_computed(self, r: _Req, events: list[KvEvent]) -> None:
        full = min(r.computed // self.config.block_size, r.n_ids)
        if full <= r.stored:
            return
        ids = r.ids
        cached = self._cached
        run: list[int] = []
        parent: int | None = ids[r.stored - 1] if r.stored > 0 else None
        for i in range(r.stored, full):
            bid = ids[i]
            if bid in cached:
                if run:
                    events.append(BlockStored(tuple(run), parent))
                    run = []
                parent = bid
                continue
            phys = r.phys[i]
            cached[bid] = phys
            self._hash[phys] = bid
            run.append(bid)
        if run:
            events.append(BlockStored(tuple(run), parent))
        r.stored = full

    # ------------------------------------------------------------------ step
    def step(self, now: float, horizon: float | None = None) -> StepResult:
        """Run one engine step starting at ``now`` (merging identical decode-only steps that start
        before ``horizon`` when one is given)."""
        if not self._running and not self._waiting:
            raise ValueError("step() on an idle engine; check next_step_time() first")
        if now < self._busy_until:
            raise ValueError(f"step at {now} while the previous step runs until {self._busy_until}")
        cfg = self.config
        costs = cfg.costs
        bs = cfg.block_size
        events: list[KvEvent] = self._pending_events
        self._pending_events = []
        res = StepResult(start=now, end=now, events=events)
        budget = cfg.max_num_batched_tokens
        n_decode = 0
        kv_read = 0
        preempted = False
        allocated = False
        prefills: list[tuple[_Req, int]] = []
        decoded_ids: list[RequestId] = []
        finished: list[_Req] = []
        # fast-forward bound: more identical steps before a completion or a block boundary
        ff_limit = 1 << 62
        running = self._running
        # Running requests first, in admission order. A decode executes at once: its state change
        # cannot affect the requests before it, and preemption only takes requests after it.
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            if r.computed < r.target:
                n = min(r.target - r.computed, budget)
                prefills.append((r, n))
                budget -= n
                i += 1
                continue
            # decoding: this step writes the KV of the last emitted token
            kv_after = r.prompt + r.outputs
            if kv_after > r.kv_cap:
                self_preempted = False
                while not self._allocate(1, events, r.phys):
                    victim = running.pop()
                    self._preempt(victim, res)
                    preempted = True
                    if victim is r:
                        self_preempted = True
                        break
                if self_preempted:
                    break  # r was the last running request: nothing after it to schedule
                r.kv_cap += bs
                allocated = True
            n_decode += 1
            kv_read += kv_after
            outputs = r.outputs + 1
            r.outputs = outputs
            decoded_ids.append(r.rid)
            rem = r.out_max - outputs
            if rem <= 0:
                finished.append(r)
            else:
                lim = min(rem - 1, r.kv_cap - kv_after)
                if lim < ff_limit:
                    ff_limit = lim
            budget -= 1
            i += 1
        all_running_scheduled = i == len(running)
        admitted = 0
        if not preempted:
            waiting = self._waiting
            while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
                r = waiting[0]
                if not self._admit(r, events):
                    break
                waiting.popleft()
                running.append(r)
                admitted += 1
                n = min(r.target - r.computed, budget)
                prefills.append((r, n))
                budget -= n
        prefill_lin = 0
        prefill_pairs = 0.0
        for r, n in prefills:
            c = r.computed
            prefill_lin += n
            prefill_pairs += n * c + n * (n + 1) / 2
            r.computed = c + n
            if r.stored < r.n_ids:
                self._store_computed(r, events)
            if r.computed == r.target:
                r.outputs += 1
                if r.outputs == 1:
                    res.first_tokens.append(FirstToken(r.rid, r.cached_tokens))
                else:
                    decoded_ids.append(r.rid)
                if r.outputs >= r.out_max:
                    finished.append(r)
        duration = (
            costs.step_overhead_s
            + costs.prefill_s_per_token * prefill_lin
            + costs.prefill_s_per_token_ctx * prefill_pairs
            + costs.decode_s_per_seq * n_decode
            + costs.decode_s_per_ctx_token * kv_read
        )
        if finished:
            done = {id(r) for r in finished}
            self._running = running = [r for r in running if id(r) not in done]
            for r in finished:
                self._release(r)
                res.finished.append(r.rid)
        res.prefill_tokens = prefill_lin
        end = now + duration
        steps = 1
        if (
            horizon is not None
            and not prefill_lin
            and not admitted
            and not preempted
            and not allocated
            and not finished
            and not events
            and all_running_scheduled
            and n_decode
            and ff_limit > 0
        ):
            extra = self._identical_steps(ff_limit, n_decode, end, duration, horizon)
            if extra:
                for r in running:
                    r.outputs += extra
                steps = 1 + extra
                g = costs.decode_s_per_ctx_token * n_decode
                # extra step j lasts duration + j g (every KV one token longer per step)
                end = now + steps * duration + g * extra * (extra + 1) / 2
        res.steps = steps
        res.decoded = [(rid, steps) for rid in decoded_ids]
        res.end = end
        self._busy_until = end
        return res

    def _identical_steps(
        self, limit: int, n_decode: int, end1: float, duration: float, horizon: float
    ) -> int:
        """How many of the next ``limit`` decode-only steps (each equal to the one just computed,
        with KV one token longer) start before ``horizon``."""
        if end1 >= horizon:
            return 0
        g = self.config.costs.decode_s_per_ctx_token * n_decode

        def start_of(j: int) -> float:
            # start of extra step j (1-based): end1 + sum_{i=1}^{j-1} (duration + i g)
            return end1 + (j - 1) * duration + g * (j - 1) * j / 2

        if start_of(limit) < horizon:
            return limit
        lo, hi = 1, limit  # the largest j with start_of(j) < horizon; start_of(1) < horizon
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if start_of(mid) < horizon:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _preempt(self, r: _Req, res: StepResult) -> None:
        self._release(r)
        if r.outputs:
            r.target = r.prompt + r.outputs
        r.computed = 0
        r.stored = 0
        self._waiting.appendleft(r)
        res.preempted.append(r.rid)
