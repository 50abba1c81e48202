"""kv_aware's parameters (the policy's rule and its weights: router_policies/policies/kv_aware.py's
docstring says what each one prices and why its default)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MISS_WEIGHT_TOKENS = 4.0  # rule tokens (kv_aware's docstring: "Why miss_weight > 1")
MISS_WEIGHT_MS = 7.0  # rule ms (kv_aware's docstring: "Why miss_weight 7 with rule ms")


class KvAwareParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rule: Literal["ms", "tokens"] = Field(
        "tokens",
        description="tokens: the prefill-token cost (the default); ms: predicted TTFT in "
        "milliseconds (opt-in: better on KV pressure and mixed hardware, worse on decode-heavy "
        "traffic, docs/simulator.md).",
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
    miss_weight: float | None = Field(
        None,
        ge=1.0,
        description="Weight of this request's own prefill: 1 for the request itself, plus the delay "
        "it adds to the requests queued behind it (default: 4 with rule tokens, 7 with rule ms).",
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
        "relative to the emptiest (0 disables): spreads new content over the fleet's caches. A "
        "prompt no replica holds gets fill_weight / miss_weight.",
    )
    speed_ratio: float = Field(
        2.0,
        ge=0.0,
        description="rule tokens: replicas whose fitted speeds differ by more than this factor "
        "(mixed hardware) are priced in their own time (0: all alike, as before 2026-12-02).",
    )
    same_speed: float = Field(
        0.3,
        ge=0.0,
        description="rule ms: replicas whose fitted speed is within this fraction of the fleet "
        "median are priced with the median replica's model (0: each with its own fit).",
    )

    room_first: bool = Field(
        True,
        description="A prompt no replica holds goes to a replica whose KV cache holds it beside "
        "its requests in flight, when one within the hot-spot guard does (kv_aware's docstring, "
        '"Room first").',
    )
    room_soonest: bool = Field(
        True,
        description="With room_first, when no replica within the hot-spot guard has room for a prompt "
        "no replica holds, it goes where its requests in flight are expected to free the room soonest "
        '(within soonest_band; router_policies/policies/kv_stall.py, "Room soonest").',
    )
    soonest_band: float = Field(
        1.2,
        ge=1.0,
        description="Room soonest takes every replica whose expected wait for room is within this "
        "multiple of the least one, and the rule's cost chooses among them.",
    )
    stall_ms: float = Field(
        500.0,
        ge=0.0,
        description="Stall relief: a replica whose oldest routed request has waited this long "
        "for its first token, and stall_factor times its queued prefill's time, is stalled; a "
        "request whose cheapest replica is stalled goes to the cheapest with nothing waiting when "
        "that costs less than the stalled one plus the stall so far (0 disables; "
        "router_policies/policies/kv_stall.py).",
    )
    stall_factor: float = Field(
        2.0,
        ge=1.0,
        description="Stall relief: how many times the time of its queued prefill (at its fitted "
        "speed) the oldest request's wait must reach for the replica to count as stalled.",
    )

    @field_validator("speed_ratio")
    @classmethod
    def _ratio_above_one(cls, v: float) -> float:
        if 0.0 < v <= 1.0:
            raise ValueError("speed_ratio must be 0 (off) or above 1")
        return v

    def miss_weight_of_rule(self) -> float:
        if self.miss_weight is not None:
            return self.miss_weight
        return MISS_WEIGHT_MS if self.rule == "ms" else MISS_WEIGHT_TOKENS
