"""kv_aware: route to the replica where the request costs least (docs/architecture.md, "Routing on
predicted milliseconds").

The default rule, ``rule: tokens``, prices the cost in prompt tokens, per healthy replica r:

    cost_r = pending_prefill_tokens_r + request_cost_tokens x load_r
             + miss_weight x (prompt_tokens - matched_r) x spread_r

(matched_r, spread_r and load_r as below). It stays the default until ``rule: ms`` meets every
simulator bar: on the synthetic Mooncake trace ``ms`` keeps 0.88-0.93 of the oracle hit rate where
the acceptance bar is 0.9, ``tests/sim/test_acceptance.py``.

The opt-in rule ``rule: ms`` prices it in milliseconds: the predicted time to first token on r plus
the delay its own prefill adds to the requests queued behind it, per healthy replica r:

    matched_r  = tokens of the request's leading blocks r holds (index match x block size);
                 set to 0 when matched_r < min_match_ratio x prompt_tokens, so that a tiny shared
                 head (a greeting, one system-prompt block) does not decide placement
    model_r    = r's fitted TTFT model (ReplicaState.ttft, exported by the model owner,
                 router_policies.ttft.model); the prior ``prior`` until r has one
    pred_r     = router_policies.ttft.features.predict(model_r, inputs_for(r, ...)): the terms
                 wait_r (the prefill queued ahead, with the decodes interleaved in every step
                 and the chunked-prefill budget), prefill_r (this request's own uncached
                 tokens, with the steps it adds), read_r (its cached tokens) and fetch_r (matched
                 blocks on slower KV tiers: fetched, or recomputed when that is cheaper)
    ttft_r     = wait_r + prefill_r + read_r + fetch_r                       (milliseconds)
    fill_r     = held_blocks_r / max over healthy replicas of held_blocks   (0 when none hold any)
    spread_r   = 1 + fill_weight x (fill_r - min over healthy replicas of fill)
    added_r    = the engine time this request's prefill adds on r for every request queued behind
                 it (its marginal work: its tokens and the share of steps they fill)
    ref_r      = model_r's TTFT of a lone 8,192-token prompt on an idle replica (its speed)
    share_r    = (mean over healthy replicas of ref) / ref_r       (``behind: fleet``, the default;
                 ``load``: (1 + load_r) / (1 + mean load); ``local``: 1)
    behind_r   = (miss_weight - 1) x share_r       (requests expected to queue behind it on r)
    cost_r     = ttft_r + (spread_r x (1 + behind_r) - 1) x added_r

The replica with the smallest cost_r wins; ties rotate deterministically (a cursor started at the
seed and advanced by ``commit``) so that an idle fleet spreads new prefixes. ``choose`` is pure;
``commit(decision)`` is called once the decision is used.

Why milliseconds: the token rule (``rule: tokens``, still the default) prices every replica's
queue in prompt tokens with a fixed ``request_cost_tokens`` per request ahead. It cannot see
decode load (a step that interleaves many decodes reading a large KV is slower for every prefill
chunk in it), nor that one replica is faster than another. pred_r sees both, and the model owner
fits each replica's coefficients online from its observed first tokens.

Why miss_weight > 1 (default 4): ttft_r is this request's own time to first token, but its
prefill (added_r) is also time that every request queued behind it on r waits. A greedy rule
(miss_weight = 1) leaves the replica holding a prefix as soon as that replica's queue is longer
than the match, which scatters shared prefixes over the fleet and, under load, costs more
recomputation than the queue it avoids. In queueing terms a unit of work at a server busy a
fraction rho of the time delays about rho / (1 - rho) later requests; 4 = 1 + 3 is rho = 0.75.
Why share_r (behind: fleet): requests queue behind this one on r in proportion to the traffic r
draws, and a replica k times faster draws about k times the traffic of a slow one, so the delay
its prefill adds to others is added_r x k x (miss_weight - 1): in fleet-mean milliseconds the
same on every replica for the same work. Its own TTFT stays in r's milliseconds. With the same
weight everywhere (``local``) a fast replica looks cheapest for every new session, draws them
all and keeps their later turns by cache affinity until its queue is far longer than the slow
replicas'. Speed is taken from whole predictions (ref_r), not from one coefficient: the online fit
trades coefficients against each other (per-step against per-token costs) while its predictions
stay right, and a per-token coefficient fed back into routing drifted (long prompts sent to the
replica whose fit looked slow per token, which then looked slower). Measured in the simulator
(8 replicas, llama3-8b-h100 or 4 H100 + 4 A100 interleaved, load 0.8; TTFT p99): agent on the mixed
fleet 12.3 s (local), 3.7 s (load), 2.8 s (fleet), 3.3 s with the token rule; the conversation
trace on H100s 10.6 s (load), 8.3 s (fleet), 8.2 s (token rule).

Why spread_r (fill_weight, default 0.5): the uncached tokens a request brings are new content that
the chosen replica's cache must absorb, evicting what it holds. Load alone cannot see this: with
requests arriving one at a time every replica's load is 0, so a short prefix shared by every
session (a system prompt) would draw every new session to the one replica that first cached it,
until its cache thrashes while the others sit empty (observed on real vLLM in ``make e2e-vllm``).
The term makes new content cost more on the replica whose cache the index already fills most,
relative to the emptiest one. When every replica holds about as much spread_r is ~1.

Hot-spot guard: a replica is a candidate only while
    load_r <= balance_rel x mean_load + balance_abs
where load is the requests ahead of a new one (``load_of``) and the mean is over healthy
replicas. Cache affinity therefore can never pile traffic onto one replica. If every replica is
excluded (impossible while the mean is a mean, kept for safety) the least loaded one wins.

Explain: ``Decision.scores`` holds cost_r; ``Decision.terms`` holds, per replica, ttft_ms,
wait_ms, prefill_ms, read_ms, fetch_ms, added_ms and cost (the token rule: cost only).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from router_policies.policy import (
    Decision,
    FleetSnapshot,
    ReplicaState,
    RequestFeatures,
    load_of,
    require_healthy,
)
from router_policies.ttft.features import REFERENCE_INPUTS, predict
from router_policies.ttft.params import NAMED_PRIORS
from router_policies.ttft.snapshot import inputs_for


class KvAwareParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rule: Literal["ms", "tokens"] = Field(
        "tokens",
        description="tokens: the prefill-token cost (the default while the ms rule misses the "
        "simulator's hit-rate bar on the synthetic trace); ms: predicted TTFT in milliseconds.",
    )
    prior: Literal["llama3-8b-h100", "small-cpu"] = Field(
        "llama3-8b-h100", description="TTFT model of a replica the model owner has not fitted yet."
    )
    min_match_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Matches below this share of the prompt count as no match."
    )
    balance_abs: float = Field(
        32.0, ge=0.0, description="Hot-spot guard: requests a replica may run above balance_rel x mean."
    )
    balance_rel: float = Field(1.5, ge=1.0, description="Hot-spot guard: multiple of the mean load.")
    request_cost_tokens: float = Field(
        64.0, ge=0.0, description="rule tokens: prefill-token equivalent of each request on a replica."
    )
    miss_weight: float = Field(
        4.0,
        ge=1.0,
        description="Weight of this request's own prefill: 1 for the request itself, plus the delay "
        "it adds to the requests queued behind it.",
    )
    behind: Literal["fleet", "load", "local"] = Field(
        "fleet",
        description="How the delay added to requests behind is scaled per replica: fleet (by the "
        "replica's prefill speed relative to the fleet mean), load ((1 + load) / (1 + mean load)), "
        "local (not scaled).",
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
        self._prior = NAMED_PRIORS[params.prior]

    def commit(self, _decision: Decision) -> None:
        """The decision was used: the next tie starts at the next replica."""
        self._cursor += 1

    def _cost(
        self, r: ReplicaState, request: RequestFeatures, matched: int, spread: float, share: float
    ) -> tuple[float, dict[str, float]]:
        p = self.params
        prompt = request.prompt_tokens
        if p.rule == "tokens":
            cost = (
                r.pending_prefill_tokens
                + p.request_cost_tokens * load_of(r)
                + p.miss_weight * (prompt - matched) * spread
            )
            return cost, {"cost": cost}
        model = r.ttft if r.ttft is not None else self._prior
        pred = predict(model, inputs_for(r, prompt, matched, request.block_size, model))
        behind = (p.miss_weight - 1.0) * share
        cost = pred.total_ms + (spread * (1.0 + behind) - 1.0) * pred.added_ms
        terms = pred.as_terms()
        terms["cost"] = round(cost, 3)
        return cost, terms

    def _behind_scale(self, healthy: list[ReplicaState], loads: list[int]) -> list[float]:
        """Per replica, the multiple of (miss_weight - 1) requests expected behind (docstring)."""
        n = len(healthy)
        if self.params.behind == "load":
            mean_load = sum(loads) / n
            return [(1.0 + x) / (1.0 + mean_load) for x in loads]
        if self.params.behind == "fleet":
            # speed as the fitted model's TTFT of one reference prompt on an idle replica: its
            # predictions are well fitted even where single coefficients trade off
            ref = [predict(r.ttft or self._prior, REFERENCE_INPUTS).total_ms for r in healthy]
            mean = sum(ref) / n
            return [mean / x if x > 0 else 1.0 for x in ref]
        return [1.0] * n

    def choose(self, request: RequestFeatures, fleet: FleetSnapshot) -> Decision:
        healthy = require_healthy(fleet)
        p = self.params
        n = len(healthy)
        loads = [load_of(r) for r in healthy]
        limit = p.balance_rel * (sum(loads) / n) + p.balance_abs
        prompt = request.prompt_tokens
        min_match = p.min_match_ratio * prompt
        start = self._cursor % n
        most_held = max(r.held_blocks for r in healthy)
        fills = [r.held_blocks / most_held if most_held else 0.0 for r in healthy]
        least_fill = min(fills)
        # the token rule reads no share: skip the per-replica reference predictions
        shares = [1.0] * n if p.rule == "tokens" else self._behind_scale(healthy, loads)
        best: ReplicaState | None = None
        best_cost = 0.0
        scores: dict[str, float] = {}
        terms: dict[str, dict[str, float]] = {}
        for j in range(n):
            idx = (start + j) % n
            r = healthy[idx]
            matched = min(r.matched_blocks * request.block_size, prompt)
            if matched < min_match:
                matched = 0
            spread = 1.0 + p.fill_weight * (fills[idx] - least_fill)
            cost, terms[r.id] = self._cost(r, request, matched, spread, shares[idx])
            scores[r.id] = cost
            if loads[idx] > limit:
                continue
            if best is None or cost < best_cost:
                best, best_cost = r, cost
        if best is None:
            best = min(healthy, key=load_of)
            return Decision(best.id, "kv_aware:all_hot", best.matched_blocks, scores, terms)
        reason = (
            "kv_aware:cache"
            if best.matched_blocks * request.block_size >= max(min_match, 1)
            else "kv_aware:load"
        )
        return Decision(best.id, reason, best.matched_blocks, scores, terms)
