"""kv_aware's stall relief (kv_aware's docstring, "Stall relief"): a replica whose queue does not
move is left for one where nothing waits.

    age_r      = how long the oldest request routed to r and still without a first token has
                 waited (ReplicaState.pending_age_ms)
    queued_r   = pending_prefill_tokens_r x r's milliseconds per token (its fit's TTFT of a lone
                 prompt of the request's size on an idle replica, over that size)
    stalled_r  = stall_ms > 0 and age_r >= stall_ms and age_r >= stall_factor x queued_r

When the replica kv_aware's rule picks is stalled, the request goes to the cheapest replica (by
the same rule's cost, within the hot-spot guard) where no request waits (age 0), if that one's
cost is below the pick's plus the stall's wait so far in the rule's units (age_r / ms per token
with the token rule; age_r with the ms rule); otherwise, or when there is none, the rule's pick
stands. The wait so far is the stall's expected rest (a wait of unknown length that has lasted
age_r is as likely to last as long again); it keeps a long prompt on its holder when recomputing
it elsewhere would take longer than the stall has.

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

Why to a replica where nothing waits, and not the cheapest other one: the move costs a miss
(its whole prefill) and a second copy of the session's prefix in a fleet short of KV. Only a
replica admitting at once is sure to be worth that against a wait of unknown length; a guard
that moved requests by predicted TTFT to any cheaper replica lost (p99 and hit rate,
docs/performance.md, "decode_heavy's seed 6").
"""

from __future__ import annotations

from collections.abc import Sequence

from router_policies.policy import ReplicaState


def stalled(r: ReplicaState, ms_per_token: float, stall_ms: float, factor: float) -> bool:
    """stalled_r (module docstring)."""
    age = r.pending_age_ms
    return stall_ms > 0 and age >= stall_ms and age >= factor * r.pending_prefill_tokens * ms_per_token


def quiet_cheapest(
    healthy: Sequence[ReplicaState], costs: Sequence[float], eligible: Sequence[bool]
) -> int | None:
    """The index of the cheapest eligible replica where no request waits (the first of equals),
    or None when there is none."""
    best: int | None = None
    for i, r in enumerate(healthy):
        if eligible[i] and r.pending_age_ms == 0 and (best is None or costs[i] < costs[best]):
            best = i
    return best
