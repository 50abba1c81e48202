"""kv_aware's stall relief, room first and room soonest (kv_aware's docstring): a replica whose
queue does not move is left for one where nothing waits and KV has room; a prompt no replica
holds goes where KV has room for it, or where room comes soonest.

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

Room soonest (``room_soonest``, ``soonest_band``). When room first finds no replica within the
guard with room for a prompt no replica holds, the prompt is priced only on the replicas within
the guard whose wait_r is at most soonest_band x the least wait_r, when every wait_r within the
guard is finite (else on all within the guard, as before):

    wait_r = when r's KV cache has room for the prompt, played forward from r.room_schedule:
             free = capacity - (in-flight KV, shared blocks once, less what the waiting take);
             each flight decoding ends at max(pace, (output - 1) x pace - its time since its
             first token) and frees its KV; each flight waiting is admitted, first come first
             served, once free covers its KV, and ends its prefill (uncached tokens at r's ms per
             token) and its output at the pace later; the prompt is admitted once free covers it
    pace   = r's measured ms per output token (FlightCounters.s_per_output_token), or its
             model's step_ms + decoding x decode_ms_per_seq while none is measured
    inf    when the schedule never frees enough: KV held by other routers' requests or by
             flights without max_tokens (no known end)

Why. Where no replica has room, a new long prompt waits for one to free room, and which one
frees first is set by the decodes and queued prefills already there, not by the queued tokens
the rule prices nor by how full the index believes each cache is: the rule sent such prompts
behind a decode of hundreds of tokens while another replica's last decode was ending. A prompt
held nowhere has no hit to lose by going where it is admitted first. Only this router's flights
are in the schedule: KV that others' requests hold (other gateways, the other workers of
``--workers N``) or that flights without max_tokens hold is never taken as freed, and a replica
whose wait is not known so is not compared with those whose wait is (it would lose to every
one of them for what the schedule does not know).

Measured (bench/live.py, 4 sim-engines of 6,400 KV tokens, the shared synthetic trace with
256-token answers, seeds 5-9; docs/performance.md, "Room soonest"): kvgate alone, TTFT p50 /
p99 55.4 / 652.6 ms without, 54.1 / 472.3 with (546 with the least wait strictly, no band); with
the peers, p99 0.53x sglang-router's (0.99x without). Versions that left the waiting requests
out, or asked for the schedule by the prompt's encoded head only, lost (p99 821-1,414 ms). The
bench's five workloads, kvgate alone before and after: within their spread.
"""

from __future__ import annotations

import heapq
import math
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


def room_wait_ms(r: ReplicaState, prompt_tokens: int, model: TtftParams, ms_per_token: float) -> float:
    """wait_r (module docstring, "Room soonest"): 0 when room_r holds; else when r's KV cache,
    freed as its flights end (``r.room_schedule``) and taken by those waiting ahead, first come
    first served, each once admitted running its prefill (``ms_per_token``) and its output, has
    room for the prompt; inf when it never has (other routers' requests, flights without a known
    end) or r has no schedule. A decoding flight ends ``output - 1`` tokens at r's pace after its
    first token, one token's time from now at the least (a stream past its expected end still
    runs); the pace is r's measured one, or its model's step with the flights decoding."""
    capacity = model.kv_capacity_tokens
    held = r.in_flight_tokens - min(r.in_flight_shared_tokens, r.in_flight_tokens)
    if held + prompt_tokens <= capacity:
        return 0.0
    plan = r.room_schedule
    if plan is None:
        return math.inf
    pace = plan.pace_ms or model.calibration * (model.step_ms + len(plan.running) * model.decode_ms_per_seq)
    ends = [(max(pace, (out - 1) * pace - since), kv) for since, out, kv in plan.running]
    heapq.heapify(ends)
    free = capacity - held + sum(kv for _out, kv, _u in plan.waiting)  # the waiting hold nothing yet
    now = 0.0
    for need, runs in (
        *((kv, u * ms_per_token + out * pace) for out, kv, u in plan.waiting),
        (prompt_tokens, None),
    ):
        while free < need and ends:
            at, frees = heapq.heappop(ends)
            now, free = max(now, at), free + frees
        if free < need:
            return math.inf
        if runs is not None:
            free -= need
            heapq.heappush(ends, (now + runs, need))
    return now


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
