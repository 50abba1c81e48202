"""kv_aware's stall relief and room first (kv_aware's docstring): a replica whose queue does not
move is left for one where nothing waits and KV has room; a prompt no replica holds goes where
KV has room for it.

    age_r      = how long the oldest request routed to r and still without a first token has
                 waited (ReplicaState.pending_age_ms)
    queued_r   = pending_prefill_tokens_r x r's milliseconds per token (its fit's TTFT of a lone
                 prompt of the request's size on an idle replica, over that size)
    stalled_r  = stall_ms > 0 and age_r >= stall_ms and age_r >= stall_factor x queued_r
    room_q     = q's KV cache holds the request beside q's requests in flight: the TTFT model's KV
                 demand (their prompts and expected outputs, shared prefix blocks once, plus this
                 request's prompt) within the capacity q's agent reported
                 (router_policies.ttft.features.kv_excess 0; the prior's guess without one).
                 Not the TTFT model's X, which counts the outputs as decoded so far (whether
                 the request is admitted now): a move is worth its miss only where the request
                 also keeps its room while the outputs beside it grow

When the replica kv_aware's rule picks (p) is stalled, the request goes to the cheapest replica q
(by the same rule's cost, within the hot-spot guard) where no request waits (age_q 0) and room_q
holds, if cost_q < cost_p + the stall's wait so far in the rule's units (age_p / p's ms per token
with the token rule; age_p with the ms rule); otherwise, or when there is none, p stands. The
wait so far stands for the stall's rest (a wait of unknown length that has lasted age_p is as
likely to last as long again); it keeps a long prompt on its holder when recomputing it
elsewhere would take longer than the stall has lasted.

Why. A queue of prefill work moves at the engine's speed, and the rule prices it (the queued
tokens). A replica whose KV cache is full of running decodes admits nothing until one of them
ends, however little prefill its queue holds: the head's wait then grows past anything its
queued prefill explains, and the rule, which sees only those few tokens (the waiting requests
mostly hit the cache), keeps sending the sessions it holds there. On the live bench's
decode_heavy workload (4 sim-engines of 400 blocks, answers up to 256 tokens) one replica at a
time stalled like this for 1-2 s while another had nothing queued and one or two decodes
running, and every first token over 500 ms was such a cache choice (an access-log replay,
docs/performance.md, "Stall relief"). The head's age is an observation, not a prediction: it is
0 on a replica where nothing waits, and on a queue of prefill it stays within its queued time,
which stall_factor leaves room for (decodes interleaved in every step slow a prefill down).

Why only to a replica where nothing waits and KV has room: the move costs a miss (its whole
prefill) and a second copy of the session's prefix in a fleet short of KV; only a replica that
admits it at once is sure to be worth that against a wait of unknown length. Without room_q the
simulator's decode-heavy profile at load 0.8 (an overloaded fleet: every replica's queue stalls
in turn, and one drained for a moment drew the moves) fell from hit rate 0.885 and TTFT p99 47 s
to 0.724 and 145 s; with it 0.861 and 49 s. A guard that moved requests by predicted TTFT to any
cheaper replica lost live (p99 and hit rate, docs/performance.md, "The held-out traces on a
slower host", its paragraph "decode_heavy's seed 6").

Room first (``room_first``). A prompt no replica holds (kv_aware's matched_r 0 everywhere) is
priced only on the replicas q within the hot-spot guard where room_q holds, when there is one;
otherwise on all within the guard as before. A prompt held somewhere is left to the rule and
to stall relief: moving it costs its hit.

Why. The token rule prices each request in flight on r at request_cost_tokens (64), and for a
prompt held nowhere the fill term weighs up to fill_weight x its uncached tokens (3,000 for a
6,000-token prompt) towards the emptier cache. Where a replica's KV is full of requests
decoding, the first outweighs nothing: a new long prompt went to the replica whose cache the
index saw emptiest, which could not admit it until a decode there ended (hundreds of ms with
256-token answers), while another replica had the room to start it at once. Such a prompt has
no hit to lose by going where it is admitted; the fill term still chooses among the replicas
with room. Measured live (bench/live.py, 4 sim-engines of 6,400 KV tokens, kvgate alone, the
two ways back to back, pooled over the seeds; docs/performance.md, "Room first"): the shared
synthetic Mooncake trace with 256-token answers (``--max-tokens 256``, prompts up to ~6,000
tokens), seeds 5-9, TTFT p50 / p99 61.4 / 799.7 ms without, 54.4 / 689.0 with (seeds 5-7 in a
run before: p99 881 against 692); decode_heavy seeds 5-7 p99 954 against 684 ms, hit rate
0.851 against 0.858; kv_pressure unchanged within its spread. In the simulator (8 H100s, the
acceptance workloads) a replica short of room is rare: the same choices but for the
conversation window (hit rate / oracle at load 1.0 0.859 against 0.847, p99 9.9 against
10.3 s).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from router_policies.policy import ReplicaState
from router_policies.ttft.features import kv_excess
from router_policies.ttft.params import TtftParams


def stalled(r: ReplicaState, ms_per_token: float, stall_ms: float, factor: float) -> bool:
    """stalled_r (module docstring)."""
    age = r.pending_age_ms
    return stall_ms > 0 and age >= stall_ms and age >= factor * r.pending_prefill_tokens * ms_per_token


def has_room(r: ReplicaState, prompt_tokens: int, model: TtftParams) -> bool:
    """room_r (module docstring); ``model``: the TTFT model r is priced with. The TTFT model's
    inputs for r (router_policies.ttft.snapshot.inputs_for) split the prompt into cached and
    uncached tokens; the KV they pin once admitted is the whole prompt either way."""
    return (
        kv_excess(r.in_flight_tokens, r.in_flight_shared_tokens, prompt_tokens, model.kv_capacity_tokens) == 0
    )


def quiet_cheapest(
    healthy: Sequence[ReplicaState], costs: Mapping[str, float], eligible: Callable[[int], bool]
) -> int | None:
    """The index in ``healthy`` of the cheapest replica (``costs`` by id) where no request waits
    and ``eligible(index)`` holds (the first of equals), or None when there is none; ``eligible``
    is asked in order of cost."""
    quiet = sorted(
        (i for i, r in enumerate(healthy) if r.pending_age_ms == 0), key=lambda i: costs[healthy[i].id]
    )
    return next((i for i in quiet if eligible(i)), None)
