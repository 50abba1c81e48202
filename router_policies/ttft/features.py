"""What a request's TTFT on one replica depends on, and the prediction (docs/architecture.md,
"Routing on predicted milliseconds").

One linear model in the coefficients of ``TtftParams`` (so that it can be fitted online, see
``estimator.py``), built on how a vLLM-like engine schedules (FCFS, chunked prefill, decodes first):

    Q  = prefill tokens queued ahead on the replica (routed there, no first token yet)
    A  = their causal-attention pairs (sum of attention_pairs over those requests; 0 if unknown)
    u  = this request's uncached prompt tokens (after the KV tiers' fetch-or-recompute choice)
    c  = its cached prompt tokens (read, not computed)
    n  = decoding sequences interleaved in every step: min(requests on the replica, max_num_seqs)
    K  = KV tokens those sequences read per step (the gateway's in-flight tokens)
    S  = of K, cached prompt tokens counted more than once: blocks predicted cached for several
         of those requests (a prefix they share), which a paged KV cache pins once however many
         requests use them (each sequence still reads them: K stays in the per-step read)
    P  = of K, the expected outputs not decoded yet (flights.FlightCounters.unproduced_tokens:
         a decoding request holds its prompt and the tokens it has produced so far)
    L  = of c, the leading tokens a request ahead holds too (its prompt leads with them)
    X  = KV demand beyond the cache when this request is admitted, in thousands:
         max(0, K - P - S + u + c - L - kv_capacity_tokens): the blocks the requests ahead hold
         now (each distinct block once, their outputs as decoded so far) and what this request's
         prompt adds. Beyond the cache the request cannot be admitted: it waits for decoding
         requests to finish and free their blocks (in a decode-heavy mix, for the running
         decodes' remaining outputs). Counting the outputs whole and this prompt's shared
         prefix again, as before, put X above 0 for most of decode_heavy's first tokens (at
         ~7 ms as at ~300 ms): the fit could not tell a stall from a full cache of shared
         prefixes (docs/performance.md, "The KV held now")
    H  = pending_age_ms: how long the oldest request ahead (routed there, no first token yet) has
         waited so far; part of the wait for the work ahead
    B  = chunk_tokens (max_num_batched_tokens); a step has B - n tokens left for prefill
    steps(W) = ceil(W / (B - n)) steps to push W prefill tokens through, at least 1 for a request

    TTFT = steps(Q + u) x (step_ms + n x decode_ms_per_seq + K x kv_read_ms_per_mtoken / 1e6)
         + (Q + u) x prefill_ms_per_token
         + (A + u x (c + (u + 1) / 2)) / 1e6 x attention_ms_per_mpair  (causal attention)
         + c x cached_ms_per_token
         + X x kv_wait_ms_per_ktoken
         + overhead_ms                  (once per request: the hop, HTTP, the running step)
         + H x queue_age_ratio
         + fetch_ms                                              (KV tiers: known, not fitted)

Every term but fetch_ms is then multiplied by ``params.calibration`` (1 for a prior): the fit's
median bias, corrected per replica (``model.Calibration``).

Its terms, reported by ``predict``: ``wait_ms`` is the same formula for the work ahead alone
(Q, no request of its own: 0 steps when Q = 0), ``prefill_ms`` the rest of the compute
(this request's own prefill, with the steps it adds), ``read_ms`` the cached-token term and
``fetch_ms`` the tiers (``prefill_ms`` includes ``overhead_ms``). Beside TTFT, ``added_ms`` is the engine time this request's prefill adds
for every request that will queue behind it: its marginal work, with the per-step costs counted
for the fraction u / (B - n) of a step its tokens fill (a step that would run anyway is not its
doing):

    added = u x prefill_ms_per_token + u x (c + (u + 1) / 2) / 1e6 x attention_ms_per_mpair
          + u / (B - n) x (step_ms + n x decode_ms_per_seq + K x kv_read_ms_per_mtoken / 1e6)
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from router_policies.ttft.params import COEFFICIENTS, TtftParams


@dataclass(frozen=True, slots=True)
class TtftInputs:
    """The observable inputs of one prediction (recorded at dispatch, fitted at first token)."""

    queued_prefill_tokens: int
    decoding: int
    kv_tokens: int
    uncached_tokens: int
    cached_tokens: int
    fetch_ms: float = 0.0
    queued_prefill_pairs: float = 0.0
    shared_kv_tokens: int = 0  # S: of kv_tokens, cached ones counted more than once (0: none)
    pending_age_ms: float = 0.0  # H: the wait so far of the oldest request ahead (0: none)
    unproduced_kv_tokens: int = 0  # P: of kv_tokens, outputs not decoded yet (0: none or unknown)
    pinned_tokens: int = 0  # L: of cached_tokens, the leading ones a request ahead holds (0: none)


# a lone 8,192-token prompt on an idle replica: its model's TTFT of it is the replica's speed
# (kv_aware's ``behind: fleet`` share; the model of median speed a joining replica adopts)
REFERENCE_INPUTS = TtftInputs(
    queued_prefill_tokens=0, decoding=0, kv_tokens=0, uncached_tokens=8192, cached_tokens=0
)


@dataclass(frozen=True, slots=True)
class TtftPrediction:
    wait_ms: float
    prefill_ms: float
    read_ms: float
    fetch_ms: float
    added_ms: float = 0.0  # not part of TTFT: the delay added to requests queued behind

    @property
    def total_ms(self) -> float:
        return self.wait_ms + self.prefill_ms + self.read_ms + self.fetch_ms

    def as_terms(self) -> dict[str, float]:
        return {
            "ttft_ms": round(self.total_ms, 3),
            "wait_ms": round(self.wait_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "read_ms": round(self.read_ms, 3),
            "fetch_ms": round(self.fetch_ms, 3),
            "added_ms": round(self.added_ms, 3),
        }


def attention_pairs(uncached: int, cached: int) -> float:
    """(token, earlier token) pairs a prefill of ``uncached`` tokens after ``cached`` ones computes."""
    return uncached * (cached + (uncached + 1) / 2)


def _steps(work: int, decoding: int, chunk: int, at_least_one: bool) -> int:
    per_step = max(1, chunk - decoding)
    s = -(-work // per_step)
    return max(1, s) if at_least_one else s


def feature_vector(inputs: TtftInputs, params: TtftParams, *, own: bool = True) -> tuple[float, ...]:
    """The features multiplying ``COEFFICIENTS`` (same order); ``own=False``: the work ahead only."""
    n = min(inputs.decoding, params.max_num_seqs)
    u = inputs.uncached_tokens if own else 0
    c = inputs.cached_tokens if own else 0
    work = inputs.queued_prefill_tokens + u
    steps = _steps(work, n, params.chunk_tokens, at_least_one=own)
    return (
        float(steps),
        float(work),
        (inputs.queued_prefill_pairs + attention_pairs(u, c)) / 1e6,
        float(steps * n),
        steps * inputs.kv_tokens / 1e6,
        float(c),
        kv_excess_now(inputs, u + c, params.kv_capacity_tokens) / 1e3,
        1.0 if own else 0.0,
        inputs.pending_age_ms,
    )


def kv_excess(kv_tokens: int, shared_kv_tokens: int, prompt_tokens: int, capacity: int) -> int:
    """X in tokens: the KV the requests ahead (K, of which S shared) and this request's prompt
    (cached or not, all pinned once admitted) take beyond ``capacity`` (shared prefix blocks
    counted once; see the module docstring)."""
    return max(0, kv_tokens - min(shared_kv_tokens, kv_tokens) + prompt_tokens - capacity)


def kv_excess_now(inputs: TtftInputs, prompt_tokens: int, capacity: int) -> int:
    """X in tokens when this request is admitted: the KV the requests ahead hold now (their
    outputs decoded so far, not the outputs they will reach) and what ``prompt_tokens`` adds
    (its leading tokens a request ahead holds are held once) beyond ``capacity``."""
    held = inputs.kv_tokens - min(inputs.unproduced_kv_tokens, inputs.kv_tokens)
    shared = min(inputs.shared_kv_tokens, held)
    own = max(0, prompt_tokens - inputs.pinned_tokens)
    return kv_excess(held, shared, own, capacity)


def dot(x: Sequence[float], theta: Sequence[float]) -> float:
    assert len(x) == len(theta) == len(COEFFICIENTS)
    return math.fsum(map(operator.mul, x, theta))


def predict(params: TtftParams, inputs: TtftInputs) -> TtftPrediction:
    theta = params.coefficients()
    full = feature_vector(inputs, params)
    read_ms = full[5] * theta[5]  # the compute terms include the KV wait (index 6)
    wait_ms = dot(feature_vector(inputs, params, own=False), theta)
    compute = dot(full, theta) - read_ms
    n = min(inputs.decoding, params.max_num_seqs)
    u = inputs.uncached_tokens
    step_share = u / max(1, params.chunk_tokens - n)
    per_step = theta[0] + n * theta[3] + inputs.kv_tokens / 1e6 * theta[4]
    k = params.calibration  # the fitted terms' median bias corrected; the tiers' fetch is known
    return TtftPrediction(
        wait_ms=k * wait_ms,
        prefill_ms=k * max(0.0, compute - wait_ms),
        read_ms=k * read_ms,
        fetch_ms=inputs.fetch_ms,
        added_ms=k
        * (u * theta[1] + attention_pairs(u, inputs.cached_tokens) / 1e6 * theta[2] + step_share * per_step),
    )


def split_cached(
    params: TtftParams, prompt_tokens: int, matched_tokens: int, on_media: Sequence[tuple[str, int]]
) -> tuple[int, int, float]:
    """(uncached, cached, fetch_ms) for a request whose first ``matched_tokens`` are held by the
    replica, ``on_media`` of them (tokens per medium) on slower tiers than the GPU. Each medium's
    tokens are fetched when that costs less than computing them, else they are recomputed; an
    unknown medium is taken as GPU (no fetch). Prompt tokens beyond the match are uncached."""
    matched = max(0, min(matched_tokens, prompt_tokens))
    recompute_per_token = params.prefill_ms_per_token
    uncached = prompt_tokens - matched
    fetch_ms = 0.0
    left = matched
    for medium, tokens in on_media:
        t = min(max(0, tokens), left)
        tier = params.tier(medium)
        if t == 0 or tier is None:
            continue
        left -= t
        fetch = tier.fetch_ms(t, params.kv_bytes_per_token)
        if fetch < t * recompute_per_token:
            fetch_ms += fetch
        else:
            uncached += t
    return uncached, prompt_tokens - uncached, fetch_ms
