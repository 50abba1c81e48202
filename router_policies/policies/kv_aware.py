"""kv_aware: route to the replica where the request costs least: its own estimated time to first
token plus the recomputation its cache misses impose on the requests queued behind it.

The rule, per healthy replica r (all quantities in prefill-token equivalents, so no engine
timing constant is needed):

    matched_r  = tokens of the request's leading blocks r holds (index match x block size);
                 set to 0 when matched_r < min_match_ratio x prompt_tokens, so that a tiny shared
                 head (a greeting, one system-prompt block) does not decide placement
    uncached_r = prompt_tokens - matched_r                      (prefill this request adds)
    queue_r    = pending_prefill_tokens_r                        (prefill already routed there)
                 + request_cost_tokens x load_r                  (each request ahead slows steps)
    fill_r     = held_blocks_r / max over healthy replicas of held_blocks   (0 when none hold any)
    spread_r   = 1 + fill_weight x (fill_r - min over healthy replicas of fill)
    cost_r     = queue_r + miss_weight x uncached_r x spread_r

The replica with the smallest cost_r wins; ties rotate deterministically (a cursor advanced per
decision, started at the seed) so that an idle fleet spreads new prefixes.

Why miss_weight > 1 (default 4): queue_r + uncached_r is this request's own time to first token,
but its uncached tokens are also work that every request queued behind it on r waits for. A
greedy rule (miss_weight = 1) leaves the replica holding a prefix as soon as that replica's queue
is longer than the match, which scatters shared prefixes over the fleet and, under load, costs
more recomputation than the queue it avoids. In queueing terms a unit of work at a server busy a
fraction rho of the time delays about rho / (1 - rho) later requests; 4 = 1 + 3 is rho = 0.75.
In the simulator (docs/simulator.md) miss_weight 1 keeps 0.65-0.76 of the oracle hit rate on the
Mooncake synthetic trace and 4 keeps 0.91-0.94, with TTFT p99 2.5 % higher at load 0.5 and lower
at 0.8 and 1.0.

Why spread_r (fill_weight, default 0.5): the uncached tokens a request brings are new content that
the chosen replica's cache must absorb, evicting what it holds. Load alone cannot see this: with
requests arriving one at a time every replica's load is 0, so a short prefix shared by every
session (a system prompt) would draw every new session to the one replica that first cached it,
until its cache thrashes while the others sit empty (observed on real vLLM in ``make e2e-vllm``).
The term makes new content cost more on the replica whose cache the index already fills most,
relative to the emptiest one, so new sessions spread over the fleet's caches, while a deep match
(few uncached tokens) still wins. When every replica holds about as much (a warm fleet, the
steady state) spread_r is ~1 for all and the rule is unchanged.

Hot-spot guard: a replica is a candidate only while
    load_r <= balance_rel x mean_load + balance_abs
where load is the requests ahead of a new one (``load_of``) and the mean is over healthy
replicas. Cache affinity therefore can never pile traffic onto one replica: once a replica is that
far above the fleet mean it receives nothing until the others catch up, whatever it holds. If
every replica is excluded (impossible while the mean is a mean, kept for safety) the least loaded
one wins.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from router_policies.policy import (
    Decision,
    FleetSnapshot,
    ReplicaState,
    RequestFeatures,
    load_of,
    require_healthy,
)


class KvAwareParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_match_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Matches below this share of the prompt count as no match."
    )
    balance_abs: float = Field(
        32.0, ge=0.0, description="Hot-spot guard: requests a replica may run above balance_rel x mean."
    )
    balance_rel: float = Field(1.5, ge=1.0, description="Hot-spot guard: multiple of the mean load.")
    request_cost_tokens: float = Field(
        64.0, ge=0.0, description="Prefill-token equivalent of each request already on a replica."
    )
    miss_weight: float = Field(
        4.0,
        ge=1.0,
        description="Weight of each uncached prompt token: 1 for the request itself, plus the delay "
        "its recomputation adds to the requests queued behind it.",
    )
    fill_weight: float = Field(
        0.5,
        ge=0.0,
        description="Extra cost of uncached tokens on a replica whose cache the index fills most, "
        "relative to the emptiest (0 disables): spreads new content over the fleet's caches.",
    )


class KvAware:
    name = "kv_aware"

    def __init__(self, params: KvAwareParams, seed: int = 0) -> None:
        self.params = params
        self._cursor = seed

    def commit(self, decision: Decision) -> None:  # placeholder until W1/W6 split choose/commit
        pass

    def choose(self, request: RequestFeatures, fleet: FleetSnapshot) -> Decision:
        healthy = require_healthy(fleet)
        p = self.params
        n = len(healthy)
        loads = [load_of(r) for r in healthy]
        limit = p.balance_rel * (sum(loads) / n) + p.balance_abs
        prompt = request.prompt_tokens
        min_match = p.min_match_ratio * prompt
        start = self._cursor % n
        self._cursor += 1
        most_held = max(r.held_blocks for r in healthy)
        fills = [r.held_blocks / most_held if most_held else 0.0 for r in healthy]
        least_fill = min(fills)
        best: ReplicaState | None = None
        best_cost = 0.0
        scores: dict[str, float] = {}
        for j in range(n):
            idx = (start + j) % n
            r = healthy[idx]
            matched = min(r.matched_blocks * request.block_size, prompt)
            if matched < min_match:
                matched = 0
            cost = (
                r.pending_prefill_tokens
                + p.request_cost_tokens * loads[idx]
                + p.miss_weight * (prompt - matched) * (1.0 + p.fill_weight * (fills[idx] - least_fill))
            )
            scores[r.id] = cost
            if loads[idx] > limit:
                continue
            if best is None or cost < best_cost:
                best, best_cost = r, cost
        if best is None:
            best = min(healthy, key=load_of)
            return Decision(best.id, "kv_aware:all_hot", best.matched_blocks, scores)
        reason = (
            "kv_aware:cache"
            if best.matched_blocks * request.block_size >= max(min_match, 1)
            else "kv_aware:load"
        )
        return Decision(best.id, reason, best.matched_blocks, scores)
