"""kv_aware: route to the replica where the request costs least (docs/architecture.md, "Routing on
predicted milliseconds").

The rule ``rule: ms`` (opt-in, see "Why the token rule stays the default") prices it in
milliseconds: the predicted time to first token on r plus the delay its own prefill adds to the
requests queued behind it, per healthy replica r:

    matched_r  = tokens of the request's leading blocks r holds and is expected to still hold
                 when its prefill starts ((index match - evicted) x block size: evicted_r, the
                 blocks the queue ahead pushes out of r's cache, ReplicaState.evicted_blocks,
                 router_policies.cache_prediction.evicted_before_prefill); set to 0 when
                 matched_r < min_match_ratio x prompt_tokens, so that a tiny shared head (a
                 greeting, one system-prompt block) does not decide placement
    own_r      = r's fitted TTFT model (ReplicaState.ttft, exported by the model owner,
                 router_policies.ttft.model); the prior ``prior`` until r has one
    ref_r      = own_r's TTFT of a lone 8,192-token prompt on an idle replica (its speed)
    model_r    = the model of the replica of median ref (the upper median) when ref_r is within
                 ``same_speed`` (default 0.3) of that median's, else own_r; ref_r then that
                 model's (``same_speed: 0``: always own_r)
    pred_r     = router_policies.ttft.features.predict(model_r, inputs_for(r, ...)): the terms
                 wait_r (the prefill queued ahead, with the decodes interleaved in every step
                 and the chunked-prefill budget), prefill_r (this request's own uncached
                 tokens, with the steps it adds), read_r (its cached tokens) and fetch_r (matched
                 blocks on slower KV tiers: fetched, or recomputed when that is cheaper)
    ttft_r     = wait_r + prefill_r + read_r + fetch_r                       (milliseconds)
    fill_r     = held_blocks_r / max over healthy replicas of held_blocks   (0 when none hold any)
    w_fill     = fill_weight, or fill_weight / miss_weight for a prompt held nowhere (matched_r 0
                 on every replica)
    spread_r   = 1 + w_fill x (fill_r - min over healthy replicas of fill)
    added_r    = the engine time this request's prefill adds on r for every request queued behind
                 it (its marginal work: its tokens and the share of steps they fill)
    share_r    = (mean over healthy replicas of ref) / ref_r       (``behind: fleet``, the default;
                 ``load``: (1 + load_r) / (1 + mean load); ``local``: 1)
    behind_r   = (miss_weight - 1) x share_r       (requests expected to queue behind it on r)
    cost_r     = ttft_r + (spread_r x (1 + behind_r) - 1) x added_r

The default rule, ``rule: tokens``, prices the cost in prompt tokens (matched_r, spread_r,
ref_r and load_r as here; miss_weight 4 by default), the queue ahead and the request's own
prefill in r's time:

    uncached_r = (prompt_tokens - matched_r) x spread_r
    speed_r    = own_r's TTFT of a lone prompt of this request's size (rounded up to a power of
                 two, 256 to 32,768 tokens) on an idle replica: the fit read where it was fitted
    group_r    = the median speed_r of r's speed group: the healthy replicas sorted by speed_r, a
                 new group wherever one's is more than speed_ratio (2 by default) times the
                 group's first (fastest); one group when speed_ratio is 0
    time_r     = group_r / (mean over healthy replicas of group_r)
    cost_r     = time_r x (pending_prefill_tokens_r + request_cost_tokens x load_r + uncached_r)
                 + (miss_weight - 1) x uncached_r

With one speed group time_r is 1: the plain rule, ``pending + request_cost_tokens x load +
miss_weight x (prompt - matched) x spread``, in the same float operations as before time_r.

The replica with the smallest cost_r wins; ties rotate deterministically (a cursor started at the
seed and advanced by ``commit``) so that an idle fleet spreads new prefixes. ``choose`` is pure;
``commit(decision)`` is called once the decision is used.

Why the token rule stays the default: with ``same_speed`` and miss_weight 7 the ms rule meets
every simulator acceptance bar (tests/sim/test_acceptance.py; hit rate / oracle 0.952 / 0.934 /
0.916 at loads 0.5 / 0.8 / 1.0 against the token rule's 0.959 / 0.900 / 0.906) with TTFT p99 within
5 % of the token rule's on identical replicas and 0.51-0.88x of it on a mixed H100 + A100 fleet.
Live (bench/live.py, 4 sim-engines) the evidence does not show it better: kvgate alone, it was
better on kv_pressure (p99 56.9 ms against 98.6), worse on decode_heavy (1,481 ms against 569);
there the fits' errors stay above 0.5, the prior takes over, and its KV-wait term counts a prefix
shared by the running requests once per request (predicted 100-200 ms, observed 15-50 ms). With the
model's KV demand counting each cached block once, the queue head's age as a term and the prior
used only when it predicts better, both rules in one run per workload (``bench/live.py --routers
kvgate_kv_aware_tokens kvgate_kv_aware_ms ...``, 2026-12-01, a host shared with other jobs), TTFT
p99 ms tokens / ms: agent 77 / 99, kv_pressure 170 / 146, hetero 78 / 61, decode_heavy 1,052 /
1,545, Mooncake 383 / 483; p50 within 4 ms of each other. No consistent winner at this noise: until
the live comparison favours it, the rule proven on real vLLM (``make e2e-vllm``) stays the default.

Why milliseconds: the token rule (``rule: tokens``) prices every replica's queue in prompt tokens
with a fixed ``request_cost_tokens`` per request ahead. It cannot see decode load (a step that
interleaves many decodes reading a large KV is slower for every prefill chunk in it), nor that one
replica is faster than another. pred_r sees both, and the model owner fits each replica's
coefficients online from its observed first tokens.

Why time_r (speed_ratio) in the token rule: without it the rule reads no speed. On a fleet where
every other engine is 3x slower (bench/live.py ``hetero``) the first prompts of new tenants (held
nowhere) went to slow replicas as often as to fast ones and made the tail: p99 53.9-57.0 ms in
three runs; with time_r 42.4-45.1 in five (speed read at 8,192 tokens), 37.5 and 41.5 at the
request's size (docs/performance.md). Only r's own part is in its time: the whole cost in r's time
piled 211-231 of 300 live requests on one replica. Groups are cut at 2x the group's fastest because
fits of identical replicas differ ("Why model_r"; cut at 1.3x, decode_heavy's split: p99 388 ms
against 57). Why speed_r at the request's size: a fit is right where it was fitted. Read on a lone
8,192-token prompt, the fits of traffic of a few hundred tokens made a 3x slower sim-engine 13x
slower, or (one prompt size only) faster. A replica fitted slow gets no new prompt, so no first
token to correct its fit: a fit with none for 10 s while its peers have theirs is priced as theirs
until a probe shows whether it is still slow (router_policies/ttft/freshness.py).

Why miss_weight > 1 (default 4 with the token rule): ttft_r is this request's own time to first
token, but its prefill (added_r) is also time that every request queued behind it on r waits. A greedy rule
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

Why model_r (same_speed): fits of identical replicas differ, not in what they predict for the
traffic they saw but in how they extrapolate (per-token costs traded for per-step or attention
costs): in the simulator, two H100 replicas' fits predicted 703 and 1,066 ms for the same new
19k-token prompt. Every new prompt (no replica holds it: about 74 % of the synthetic trace's requests)
then went where the fit happened to look cheapest, not by queue and cache fill, and with ``behind:
fleet`` the replica whose fit looked slow also looked cheap for the requests behind. Within 30 % of
the median speed, replicas are taken as the same hardware and priced alike; a replica of another
kind (an A100 beside H100s: 3x slower to prefill) stays outside it and keeps its own model.

Why miss_weight 7 with rule ms: ttft_r prices the queue ahead at its true cost, with the causal
attention of the long prompts in it and the per-step decode load, where the token rule counts its
tokens only; with the same weight 4 the ms rule left a holder with a long queue more often than
the token rule and kept 0.87 of the oracle hit rate on the synthetic trace at load 1.0 (the
acceptance bar is 0.9). Sweep (tests/sim/test_acceptance.py's inputs, 8 H100s, with model_r;
hit rate / oracle at loads 0.5 / 0.8 / 1.0): weight 4: 0.940 / 0.901 / 0.868; 6: 0.951 / 0.923 /
0.891; 7: 0.952 / 0.934 / 0.916; 8: 0.963 / 0.926 / 0.921. TTFT p99 moved by less than 5 % on
the synthetic trace; on the conversation window 7 gave 9.1 / 9.1 / 9.8 s (6: 13.8 s at 0.5, 8:
16.3 s at 1.0: the longest prompts queued behind each other on their holders). Without model_r,
weights 5 to 8 swung the synthetic hit rate between 0.89 and 0.94 from one load to the next.

Why spread_r (fill_weight, default 0.5): the uncached tokens a request brings are new content that
the chosen replica's cache must absorb, evicting what it holds. Load alone cannot see this: with
requests arriving one at a time every replica's load is 0, so a short prefix shared by every
session (a system prompt) would draw every new session to the one replica that first cached it,
until its cache thrashes while the others sit empty (observed on real vLLM in ``make e2e-vllm``).
The term makes new content cost more on the replica whose cache the index already fills most,
relative to the emptiest one. When every replica holds about as much spread_r is ~1.
Why w_fill: a prompt no replica holds (matched_r 0 everywhere) is new content wherever it goes,
and with the full weight the term made it wait behind up to miss_weight x fill_weight x its own
uncached tokens more for an emptier cache (4 x 0.5 x 5,000 = 10,000 queued tokens for a cold
5,000-token prompt): on a live trace of little reuse (the shared synthetic Mooncake trace's first
300 requests, 4 sim-engines) TTFT p99 122-130 ms. With fill_weight / miss_weight the term adds at
most fill_weight x its own uncached tokens (half its own prefill): p99 89 / 98 / 131 ms (three
seeds). Switched off there altogether it gave 87-97 ms, but the heterogeneous fleet's hit rate fell
to 0.73 on one seed (vllm-router's 0.79): new tenants' content then piles onto the fast replicas'
caches (docs/performance.md, "The fill term and new content").

Hot-spot guard: a replica is a candidate only while
    load_r <= balance_rel x mean_load + balance_abs
where load is the requests ahead of a new one (``load_of``) and the mean is over healthy
replicas. Cache affinity therefore can never pile traffic onto one replica. If every replica is
excluded (impossible while the mean is a mean, kept for safety) the least loaded one wins.

Room first and room soonest (``room_first``, ``room_soonest``; router_policies/policies/
kv_stall.py): a prompt no replica holds (matched_r 0 on every replica) is priced only on the
replicas within the guard whose KV cache holds it beside their requests in flight (room_r), when
there is one; else, when every wait_r there is known, on those where room comes soonest, within
``soonest_band`` x the least (``room_wait_ms`` in the terms). Reason ``kv_aware:room`` when either passes over a cheaper
replica within the guard.

Stall relief (``stall_ms``, ``stall_factor``; router_policies/policies/kv_stall.py): when the
replica of least cost is stalled (its oldest routed request has waited for its first token at
least stall_ms, and stall_factor times its queued prefill's time: a KV cache full of decodes
admits nothing however little prefill waits), the request goes to the cheapest replica within
the guard where no request waits and whose KV cache has room for it beside its requests in
flight (reason ``kv_aware:stall``), if its cost is below the stalled one's plus that wait so far
(in the rule's units: tokens at r's speed, or ms); otherwise, or with none, the choice stands.

Explain: ``Decision.scores`` holds cost_r; ``Decision.terms`` holds, per replica, ttft_ms,
wait_ms, prefill_ms, read_ms, fetch_ms, added_ms and cost (the token rule: cost and time_r).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from router_policies.policies.kv_aware_params import KvAwareParams
from router_policies.policies.kv_speed import speed_groups, speed_size
from router_policies.policies.kv_stall import has_room, quiet_cheapest, room_wait_ms, stalled
from router_policies.policy import (
    Decision,
    FleetSnapshot,
    ReplicaState,
    RequestFeatures,
    load_of,
    require_healthy,
)
from router_policies.ttft.features import REFERENCE_INPUTS, predict
from router_policies.ttft.params import NAMED_PRIORS, TtftParams
from router_policies.ttft.snapshot import inputs_for

# _reference_ms remembers at most this many (params, size) per healthy replica, plus the one
# decision's own after a clear (mostly params no longer current)
REFS_PER_REPLICA = 8


class _Candidate(NamedTuple):
    """One replica's figures for ``_cost`` (docstring: matched_r, spread_r, share_r, model_r, time_r)."""

    matched: int
    spread: float
    share: float
    model: TtftParams
    time: float = 1.0


class KvAware:
    name = "kv_aware"

    def __init__(self, params: KvAwareParams, seed: int = 0) -> None:
        self.params = params
        self._cursor = seed
        self._prior = NAMED_PRIORS[params.prior]
        self._miss_weight = params.miss_weight_of_rule()
        self._refs: dict[tuple[int, int], tuple[TtftParams, float]] = {}  # _reference_ms's memory

    def commit(self, _decision: Decision) -> None:
        """The decision was used: the next tie starts at the next replica."""
        self._cursor += 1

    def _cost(
        self, r: ReplicaState, request: RequestFeatures, c: _Candidate
    ) -> tuple[float, dict[str, float]]:
        p = self.params
        prompt = request.prompt_tokens
        if p.rule == "tokens":
            ahead = r.pending_prefill_tokens + p.request_cost_tokens * load_of(r)
            if c.time == 1.0:
                cost = ahead + self._miss_weight * (prompt - c.matched) * c.spread
            else:
                uncached = (prompt - c.matched) * c.spread
                cost = c.time * (ahead + uncached) + (self._miss_weight - 1.0) * uncached
            return cost, {"cost": cost, "time": c.time}
        pred = predict(c.model, inputs_for(r, prompt, c.matched, request.block_size, c.model))
        behind = (self._miss_weight - 1.0) * c.share
        cost = pred.total_ms + (c.spread * (1.0 + behind) - 1.0) * pred.added_ms
        terms = pred.as_terms()
        terms["cost"] = round(cost, 3)
        return cost, terms

    def _reference_ms(self, model: TtftParams, tokens: int = REFERENCE_INPUTS.uncached_tokens) -> float:
        """The TTFT of a lone ``tokens``-token prompt (a power of two) on an idle replica by
        ``model``, remembered per params object: a fit exports a new one at each first token, so
        most requests find every replica's unchanged. The entry holds the object, so its id is
        not reused while remembered."""
        hit = self._refs.get((id(model), tokens))
        if hit is not None and hit[0] is model:
            return hit[1]
        ref = predict(model, replace(REFERENCE_INPUTS, uncached_tokens=tokens)).total_ms
        self._refs[(id(model), tokens)] = (model, ref)
        return ref

    def _own_refs(
        self, healthy: list[ReplicaState], tokens: int = REFERENCE_INPUTS.uncached_tokens
    ) -> tuple[list[TtftParams], list[float]]:
        if len(self._refs) > REFS_PER_REPLICA * len(healthy):  # mostly params no longer current
            self._refs.clear()
        own = [self._model_of(r) for r in healthy]
        return own, [self._reference_ms(m, tokens) for m in own]

    def _times(self, healthy: list[ReplicaState], prompt_tokens: int) -> list[float]:
        """Per replica, time_r (docstring): its speed group's speed_r over the fleet mean."""
        ratio = self.params.speed_ratio
        refs = self._own_refs(healthy, speed_size(prompt_tokens))[1] if ratio else ()
        if not refs or max(refs) <= ratio * min(refs):  # one group (the usual fleet)
            return [1.0] * len(healthy)
        groups = speed_groups(list(refs), ratio)
        mean = sum(groups) / len(groups)
        return [g / mean if mean > 0 else 1.0 for g in groups]

    def _models(self, healthy: list[ReplicaState]) -> tuple[list[TtftParams], list[float]]:
        """Per replica, the TTFT model it is priced with and that model's reference TTFT (its
        speed): its own fit, or the fleet median's when within ``same_speed`` of it."""
        own, refs = self._own_refs(healthy)
        tol = self.params.same_speed
        if tol <= 0:
            return own, refs
        mid = sorted(range(len(own)), key=refs.__getitem__)[len(own) // 2]
        models, out_refs = [], []
        for m, ref in zip(own, refs, strict=True):
            same = refs[mid] > 0 and abs(ref / refs[mid] - 1.0) <= tol
            models.append(own[mid] if same else m)
            out_refs.append(refs[mid] if same else ref)
        return models, out_refs

    def _model_of(self, r: ReplicaState) -> TtftParams:
        return r.ttft if r.ttft is not None else self._prior

    def _stall_cost(self, r: ReplicaState, prompt_tokens: int) -> float:
        """The wait of a stalled r in the rule's units, 0 when r is not stalled
        (router_policies/policies/kv_stall.py); r's speed is read only past stall_ms."""
        p = self.params
        if not p.stall_ms or r.pending_age_ms < p.stall_ms:
            return 0.0
        size = speed_size(prompt_tokens)
        ms_per_token = self._reference_ms(self._model_of(r), size) / size
        if not stalled(r, ms_per_token, p.stall_ms, p.stall_factor):
            return 0.0
        return r.pending_age_ms / ms_per_token if p.rule == "tokens" else r.pending_age_ms

    def _room_waits(
        self, healthy: list[ReplicaState], guarded: list[bool], prompt_tokens: int
    ) -> list[float]:
        """wait_r of room soonest (kv_stall.room_wait_ms) for the replicas within the guard (inf
        for the others), each priced with its own model's prefill speed."""
        size = speed_size(prompt_tokens)
        return [
            room_wait_ms(r, prompt_tokens, m, self._reference_ms(m, size) / size) if ok else math.inf
            for ok, r, m in zip(guarded, healthy, map(self._model_of, healthy), strict=True)
        ]

    def _behind_scale(self, refs: list[float], loads: list[int]) -> list[float]:
        """Per replica, the multiple of (miss_weight - 1) requests expected behind (docstring)."""
        n = len(refs)
        if self.params.behind == "load":
            mean_load = sum(loads) / n
            return [(1.0 + x) / (1.0 + mean_load) for x in loads]
        if self.params.behind == "fleet":
            # speed as the model's TTFT of one reference prompt on an idle replica: its
            # predictions are well fitted even where single coefficients trade off
            mean = sum(refs) / n
            return [mean / x if x > 0 else 1.0 for x in refs]
        return [1.0] * n

    def choose(self, request: RequestFeatures, fleet: FleetSnapshot) -> Decision:
        healthy = require_healthy(fleet)
        p = self.params
        n = len(healthy)
        loads = [load_of(r) for r in healthy]
        limit = p.balance_rel * (sum(loads) / n) + p.balance_abs
        prompt = request.prompt_tokens
        # matched_r (docstring): a match below min_match_ratio of the prompt counts as none
        min_match = max(p.min_match_ratio * prompt, 1.0)
        matches = [min(r.expected_blocks * request.block_size, prompt) for r in healthy]
        matches = [m if m >= min_match else 0 for m in matches]
        start = self._cursor % n
        most_held = max(r.held_blocks for r in healthy)
        # a prompt no replica holds waits at most fill_weight x its own uncached tokens more for
        # an emptier cache (docstring: w_fill)
        fill_weight = p.fill_weight if any(matches) else p.fill_weight / self._miss_weight
        fills = [r.held_blocks / most_held if most_held else 0.0 for r in healthy]
        least_fill = min(fills)
        if p.rule == "tokens":  # no model to price with; the speeds only
            models, shares, times = [self._prior] * n, [1.0] * n, self._times(healthy, prompt)
        else:
            models, refs = self._models(healthy)
            shares, times = self._behind_scale(refs, loads), [1.0] * n
        guarded = [x <= limit for x in loads]
        eligible = guarded
        waits: list[float] = []
        if p.room_first and not any(matches):  # room first (docstring)
            roomy = [
                ok and has_room(r, prompt, self._model_of(r)) for ok, r in zip(guarded, healthy, strict=True)
            ]
            if any(roomy):
                eligible = roomy
            elif p.room_soonest:  # room soonest (docstring)
                waits = self._room_waits(healthy, guarded, prompt)
                if all(w < math.inf for w, ok in zip(waits, guarded, strict=True) if ok):
                    eligible = [w <= p.soonest_band * min(waits) for w in waits]
        best: int | None = None
        best_cost = 0.0
        scores: dict[str, float] = {}
        terms: dict[str, dict[str, float]] = {}
        for j in range(n):
            idx = (start + j) % n
            r = healthy[idx]
            spread = 1.0 + fill_weight * (fills[idx] - least_fill)
            cost, terms[r.id] = self._cost(
                r, request, _Candidate(matches[idx], spread, shares[idx], models[idx], times[idx])
            )
            scores[r.id] = cost
            if eligible[idx] and (best is None or cost < best_cost):
                best, best_cost = idx, cost
        for r, w in zip(healthy, waits, strict=False):  # room soonest's, for explain
            if w < math.inf:
                terms[r.id]["room_wait_ms"] = round(w, 3)
        if best is None:
            hot = min(healthy, key=load_of)
            return Decision(hot.id, "kv_aware:all_hot", hot.matched_blocks, scores, terms)
        stall_cost = self._stall_cost(healthy[best], prompt)
        if stall_cost:  # stall relief (docstring)
            quiet = quiet_cheapest(
                healthy,
                scores,
                lambda i: loads[i] <= limit and has_room(healthy[i], prompt, self._model_of(healthy[i])),
            )
            if quiet is not None and scores[healthy[quiet].id] < best_cost + stall_cost:
                r = healthy[quiet]
                return Decision(r.id, "kv_aware:stall", r.matched_blocks, scores, terms)
        reason = "kv_aware:cache" if matches[best] else "kv_aware:load"
        if eligible is not guarded and best_cost > min(
            scores[r.id] for r, ok in zip(healthy, guarded, strict=True) if ok
        ):
            reason = "kv_aware:room"  # room first passed over a cheaper replica within the guard
        return Decision(healthy[best].id, reason, healthy[best].matched_blocks, scores, terms)
