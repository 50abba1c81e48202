"""The fitted TTFT model of one replica as an immutable value (docs/architecture.md, "Routing on
predicted milliseconds"), and the KV tiers it prices.

A ``TtftParams`` is what the model owner (``router_policies.ttft.model.TtftModel``) exports per
replica after each observation and what the fleet snapshot carries on ``ReplicaState.ttft``, so
that a policy stays a pure function of the snapshot. Coefficients are milliseconds:

    step_ms                 fixed cost of one engine step (weights streamed once, scheduling)
    prefill_ms_per_token    each prompt token computed (the linear, weights-and-MLP part)
    attention_ms_per_mpair  causal attention: per million (token, earlier token) pairs computed
    decode_ms_per_seq       each decoding sequence interleaved in a step
    kv_read_ms_per_mtoken   per step, per million KV tokens the decoding sequences read
    cached_ms_per_token     each cached prompt token the prefill reads instead of computing
    kv_wait_ms_per_ktoken   per thousand tokens of KV demand beyond the cache's capacity: the
                            queue cannot be admitted until decoding requests finish and free it
    overhead_ms             once per request: the time from dispatch to first byte that is not
                            engine steps (the hop to the engine and back, HTTP, tokenization, the
                            step already running when it arrives); 0 in the priors (the simulator
                            has no hop), fitted live
    queue_age_ratio         per ms that the oldest request routed to the replica and still awaiting
                            its first token has waited (``pending_age_ms``): a queue that does not
                            move (prompts that cannot be admitted until running decodes finish and
                            free KV; an engine stalled) shows in how long its head has waited,
                            before any first token says so. FCFS: a new request is admitted after
                            that head, whose remaining wait is of the order of its wait so far
                            when the queue is blocked, and already counted by the queued-prefill
                            terms when it is merely long: 0.5 in the priors, fitted per replica

``chunk_tokens`` (the engine's ``max_num_batched_tokens``), ``max_num_seqs`` and
``kv_capacity_tokens`` (its KV cache) are engine settings, not fitted: they come with the prior. ``kv_bytes_per_token`` prices the KV tiers.

Tiers: a matched block held on a slower medium than the GPU must be fetched before the prefill can
read it: ``latency_ms + tokens x kv_bytes_per_token / bandwidth``. Defaults (``DEFAULT_TIERS``):
host DRAM 0.1 ms + PCIe 4.0 x16 at ~25 GB/s effective; local NVMe 1 ms + ~5 GB/s (one PCIe 4.0
x4 drive's sequential read); a remote store (Mooncake/LMCache over RDMA or TCP) 5 ms + ~10 GB/s
(100 Gb/s links). For Llama-3-8B (128 KiB of KV per token) fetching from NVMe costs 26 us/token
against 40.6 us/token of H100 prefill: fetching wins beyond ~70 tokens, recomputing a short tail
is cheaper. A prefill that recomputes instead is priced as uncached, whichever is smaller.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from itertools import repeat
from typing import Protocol


@dataclass(frozen=True, slots=True)
class TierCost:
    latency_ms: float  # first byte from that medium
    gb_per_s: float  # sustained read bandwidth, 1e9 bytes/s

    def fetch_ms(self, tokens: int, kv_bytes_per_token: int) -> float:
        return self.latency_ms + tokens * kv_bytes_per_token / (self.gb_per_s * 1e6)


DEFAULT_TIERS: Mapping[str, TierCost] = {
    "CPU": TierCost(0.1, 25.0),
    "DISK": TierCost(1.0, 5.0),
    "REMOTE": TierCost(5.0, 10.0),
}

# Names of the fitted coefficients, in the order of the feature vector (``features.py``).
COEFFICIENTS = (
    "step_ms",
    "prefill_ms_per_token",
    "attention_ms_per_mpair",
    "decode_ms_per_seq",
    "kv_read_ms_per_mtoken",
    "cached_ms_per_token",
    "kv_wait_ms_per_ktoken",
    "overhead_ms",
    "queue_age_ratio",
)


@dataclass(frozen=True, slots=True)
class TtftParams:
    step_ms: float
    prefill_ms_per_token: float
    attention_ms_per_mpair: float = 0.0
    decode_ms_per_seq: float = 0.0
    kv_read_ms_per_mtoken: float = 0.0
    cached_ms_per_token: float = 0.0
    kv_wait_ms_per_ktoken: float = 20.0
    overhead_ms: float = 0.0
    queue_age_ratio: float = 0.5
    chunk_tokens: int = 8192
    max_num_seqs: int = 256
    kv_capacity_tokens: int = 400_000
    kv_bytes_per_token: int = 131_072
    tiers: Mapping[str, TierCost] = field(default_factory=lambda: DEFAULT_TIERS)
    observations: int = 0  # first tokens the fit has seen (0: the prior itself)
    error_ratio: float = 0.0  # the fit's robust scale of relative residuals (0: no observation)
    # every fitted term of a prediction is multiplied by it: the fit's median bias, corrected
    # (``model.Calibration``); 1 for a prior
    calibration: float = 1.0
    # the coefficients in ``COEFFICIENTS`` order, as floats: derived from the fields above, set
    # once by ``__post_init__`` or ``with_coefficients`` (every prediction reads them)
    _theta: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name, None)
            if isinstance(v, int | float) and v < 0:
                raise ValueError(f"{f.name}: must be >= 0")
        if not self.calibration > 0:
            raise ValueError("calibration: must be > 0")
        if self.chunk_tokens < 2 or self.max_num_seqs < 1:
            raise ValueError("chunk_tokens must be >= 2 and max_num_seqs >= 1")
        object.__setattr__(self, "_theta", tuple(float(getattr(self, n)) for n in COEFFICIENTS))

    def coefficients(self) -> tuple[float, ...]:
        return self._theta

    def with_coefficients(
        self,
        values: tuple[float, ...],
        observations: int,
        error_ratio: float,
        calibration: float | None = None,
    ) -> TtftParams:
        """A copy with fitted coefficients (and ``calibration``, default this one's). Called at
        every first byte, so it copies the slots instead of ``dataclasses.replace`` (whose field
        walk and re-validation cost ~30 us); the checks that could fail on fitted values are
        repeated here."""
        assert len(values) == len(COEFFICIENTS)
        if calibration is None:
            calibration = self.calibration
        if min(values) < 0 or observations < 0 or error_ratio < 0:
            raise ValueError("fitted coefficients must be >= 0")
        if not calibration > 0:
            raise ValueError("calibration must be > 0")
        new = object.__new__(TtftParams)
        # the slot writes in C-level passes (a Python loop over the slots was ~6 us)
        deque(map(_SET, repeat(new), _KEPT, _GET_KEPT(self)), maxlen=0)
        deque(map(_SET, repeat(new), COEFFICIENTS, values), maxlen=0)
        _SET(new, "_theta", tuple(map(float, values)))
        _SET(new, "observations", observations)
        _SET(new, "error_ratio", error_ratio)
        _SET(new, "calibration", calibration)
        return new

    def tier(self, medium: str) -> TierCost | None:
        return self.tiers.get(medium.upper())


# what ``with_coefficients`` copies as it is (every slot but the fitted ones and what they decide)
_KEPT = tuple(
    f.name
    for f in fields(TtftParams)
    if f.name not in {*COEFFICIENTS, "_theta", "observations", "error_ratio", "calibration"}
)
_GET_KEPT = operator.attrgetter(*_KEPT)
_SET = object.__setattr__  # a frozen dataclass's own __setattr__ refuses


class StepCostsLike(Protocol):
    """An engine's step costs in seconds (the simulator's ``StepCosts``)."""

    @property
    def step_overhead_s(self) -> float: ...
    @property
    def prefill_s_per_token(self) -> float: ...
    @property
    def prefill_s_per_token_ctx(self) -> float: ...
    @property
    def decode_s_per_seq(self) -> float: ...
    @property
    def decode_s_per_ctx_token(self) -> float: ...


def params_from_step_costs(
    costs: StepCostsLike, chunk_tokens: int, max_num_seqs: int, kv_capacity_tokens: int
) -> TtftParams:
    """A prior from an engine's step costs (the simulator's step-cost formula, in ms)."""
    c = costs
    return TtftParams(
        c.step_overhead_s * 1e3,
        c.prefill_s_per_token * 1e3,
        c.prefill_s_per_token_ctx * 1e9,
        c.decode_s_per_seq * 1e3,
        c.decode_s_per_ctx_token * 1e9,
        chunk_tokens=chunk_tokens,
        max_num_seqs=max_num_seqs,
        kv_capacity_tokens=kv_capacity_tokens,
    )


# Llama-3-8B BF16 on one H100 SXM (the simulator's ``llama3-8b-h100`` profile derives these from
# the datasheet and the model's shape; router_policies/sim/profiles.py): 8.0 ms per step,
# 40.6 us per prefill token, 1.33 ns per attention pair, 40.6 us per decoding sequence, 55.8 ns
# per KV token read; 400k tokens of KV. kv_wait_ms_per_ktoken (all priors): a request holds its
# KV for its decode, seconds (200 tokens at ~20 ms per step: 4 s), so a 400k-token cache turns
# over at ~100k tokens/s: ~10 ms per thousand tokens of excess demand, doubled because the
# excess is queued behind requests that are themselves still prefilling. The gateway's
# cold-start prior when nothing better is configured.
DEFAULT_PRIOR = TtftParams(8.035, 0.0406, 1.325, 0.0406, 55.9)


# The simulator's ``small-cpu`` profile (the seed's small model on CPU): 174.6 ms per step,
# 0.963 ms per prefill token and per decoding sequence, 4,096 tokens per step, 64 sequences.
SMALL_CPU_PRIOR = TtftParams(
    174.6, 0.9627, 0.0, 0.9627, chunk_tokens=4096, max_num_seqs=64, kv_capacity_tokens=65_536
)

NAMED_PRIORS: Mapping[str, TtftParams] = {"llama3-8b-h100": DEFAULT_PRIOR, "small-cpu": SMALL_CPU_PRIOR}
