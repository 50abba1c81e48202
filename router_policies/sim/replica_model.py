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
    A full prompt block becomes cached (``BlockStored`` with its parent id) when the step that
    computes its last token is scheduled, so a request admitted later in that step hits it (vLLM
    v1's ``KVCacheManager.allocate_slots`` caches the blocks of the tokens it schedules, running
    requests before waiting ones). If the same id is already cached (two requests computed one
    prefix concurrently) the second copy stays uncached, so that the cached set is exactly a set of
    ids and replaying the events reproduces it (vLLM keeps both copies and reports the store
    twice).

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
prefix_cache_queries / prefix_cache_hits in tokens, counted at a request's first admission only:
vLLM's ``PrefixCacheStats.record`` (vllm/v1/metrics/stats.py, 0.32) sets a previously preempted
request's lookups apart (``preempted_queries``), so its re-admission, which finds its own blocks,
does not count as a hit for the router that placed it.
"""

from __future__ import annotations

from collections import deque

from router_policies.sim.engine_types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineConfig,
    EngineMetrics,
    EngineRequest,
    FirstToken,
    KvEvent,
    ReqState,
    RequestId,
    RequestTooLargeError,
    StepCosts,
    StepResult,
)
from router_policies.sim.kv_blocks import BlockPool

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineConfig",
    "EngineMetrics",
    "EngineRequest",
    "FirstToken",
    "KvEvent",
    "ReplicaModel",
    "RequestId",
    "RequestTooLargeError",
    "StepCosts",
    "StepResult",
]


class ReplicaModel:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._pool = BlockPool(config.num_blocks, config.block_size)
        self._waiting: deque[ReqState] = deque()
        self._running: list[ReqState] = []  # admission order
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
        self._waiting.append(ReqState(req))
        self._last_submit = max(self._last_submit, now)

    def clear(self) -> bool:
        """vLLM's reset_prefix_cache: forget every cached id. Refused (False) while any block is
        pinned by a request. The ``AllBlocksCleared`` event comes with the next step."""
        return self._pool.clear(self._pending_events)

    def abort(self, request_id: RequestId) -> bool:
        """vLLM's abort (the client went away): drop a waiting or running request between steps.
        Its blocks are released like a finished request's (cached ones stay cached, no event).
        False when the request is not in the engine."""
        for i, r in enumerate(self._running):
            if r.req.request_id == request_id:
                del self._running[i]
                self._pool.release(r)
                return True
        for r in self._waiting:
            if r.req.request_id == request_id:
                self._waiting.remove(r)
                self._pool.release(r)  # no-op unless it holds blocks
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
            kv_usage=(n - self._pool.free_count()) / n,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    def load(self) -> tuple[int, int, float]:
        """(running, waiting, kv_usage) without building an ``EngineMetrics``."""
        n = self.config.num_blocks
        return len(self._running), len(self._waiting), (n - self._pool.free_count()) / n

    @property
    def busy_until(self) -> float:
        return self._busy_until

    def cached_ids(self) -> set[int]:
        return self._pool.cached_ids()

    def is_cached(self, block_id: int) -> bool:
        return self._pool.is_cached(block_id)

    def _admit(self, r: ReqState, events: list[KvEvent]) -> bool:
        """Admit ``r`` if the free queue can supply its blocks; False leaves everything unchanged."""
        first = r.cached_tokens < 0  # set by the pool at the first admission
        hits = self._pool.admit(r, events)
        if hits < 0:
            return False
        if first:
            self._queries += r.prompt
            self._hits += hits * self.config.block_size
        return True

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
        prefills: list[tuple[ReqState, int]] = []
        decoded_ids: list[RequestId] = []
        finished: list[ReqState] = []
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
                self._pool.store_scheduled(r, r.computed + n, events)
                i += 1
                continue
            # decoding: this step writes the KV of the last emitted token
            kv_after = r.prompt + r.outputs
            if kv_after > r.kv_cap:
                self_preempted = False
                while not self._pool.allocate(1, events, r.phys):
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
                self._pool.store_scheduled(r, r.computed + n, events)
        prefill_lin = 0
        prefill_pairs = 0.0
        for r, n in prefills:
            c = r.computed
            prefill_lin += n
            prefill_pairs += n * c + n * (n + 1) / 2
            r.computed = c + n
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
                self._pool.release(r)
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

    def _preempt(self, r: ReqState, res: StepResult) -> None:
        self._pool.release(r)
        if r.outputs:
            r.target = r.prompt + r.outputs
        r.computed = 0
        r.stored = 0
        self._waiting.appendleft(r)
        res.preempted.append(r.rid)
