"""From a fleet snapshot's ``ReplicaState`` to the inputs of the TTFT model: the one function
the policy predicts with and the gateway and simulator record at dispatch (docs/architecture.md,
"Routing on predicted milliseconds").

    queued_prefill_tokens = pending_prefill_tokens (routed there, no first token yet)
    queued_prefill_pairs  = pending_prefill_pairs (their attention pairs)
    decoding              = load_of(state): every request ahead will be decoding in the steps
                            that prefill this one (running now, or admitted before it)
    kv_tokens             = in_flight_tokens (prompt + expected output of those requests)
    shared_kv_tokens      = in_flight_shared_tokens (their cached prompt tokens counted more than once)
    pending_age_ms        = pending_age_ms (the wait so far of the oldest of them without a first token)
    unproduced_kv_tokens  = in_flight_unproduced_tokens (of kv_tokens, outputs not decoded yet)
    pinned_tokens         = pinned_blocks x block_size, at most the cached tokens
    uncached / cached / fetch_ms: ``split_cached`` of the matched tokens, the matched blocks on
                            slower media (``ReplicaState.matched_on_media``) priced by the tiers
"""

from __future__ import annotations

from router_policies.policy import ReplicaState, load_of
from router_policies.ttft.features import TtftInputs, split_cached
from router_policies.ttft.params import TtftParams


def inputs_for(
    state: ReplicaState, prompt_tokens: int, matched_tokens: int, block_size: int, params: TtftParams
) -> TtftInputs:
    media = [(medium, blocks * block_size) for medium, blocks in state.matched_on_media]
    uncached, cached, fetch_ms = split_cached(params, prompt_tokens, matched_tokens, media)
    return TtftInputs(
        queued_prefill_tokens=state.pending_prefill_tokens,
        decoding=load_of(state),
        kv_tokens=state.in_flight_tokens,
        uncached_tokens=uncached,
        cached_tokens=cached,
        fetch_ms=fetch_ms,
        queued_prefill_pairs=state.pending_prefill_pairs,
        shared_kv_tokens=state.in_flight_shared_tokens,
        pending_age_ms=state.pending_age_ms,
        unproduced_kv_tokens=state.in_flight_unproduced_tokens,
        pinned_tokens=min(cached, state.pinned_blocks * block_size),
    )
