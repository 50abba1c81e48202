"""The ``operator`` section of the gateway config: trace recording, prices, cache lifetime
(docs/operators.md; docs/architecture.md, "Operator view").

Prices are per model, in USD per million prompt tokens: ``input`` for tokens the engine computed,
``cached_input`` for tokens it served from its prefix cache. A model without a price has its
tokens and engine time counted but no money value. ``PUBLISHED_PRICES`` are defaults for hosted
API models, each with the date it was written down; a configured price always wins.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic.types import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from gateway.config_http import _Strict  # the base of every config section


class Price(_Strict):
    """USD per million prompt tokens."""

    input: NonNegativeFloat = Field(description="Fresh (computed) prompt tokens, USD per million.")
    cached_input: NonNegativeFloat = Field(
        description="Prompt tokens read from the prefix cache, USD per million."
    )
    source: str = Field("configured", description="Where the figure comes from, with its date.")

    @model_validator(mode="after")
    def _cached_not_dearer(self) -> Price:
        if self.cached_input > self.input:
            raise ValueError("cached_input must not exceed input")
        return self


# Written down on 2026-12-01 from the figures quoted in kvgate issue 16 (DeepSeek's published API
# price list: 0.27 USD fresh, 0.07 USD cache hit, per million input tokens, standard hours). Not
# re-checked against the vendor's page since; configure operator.prices to override.
PUBLISHED_PRICES: dict[str, Price] = {
    name: Price(input=0.27, cached_input=0.07, source="DeepSeek API price list, as written down 2026-12-01")
    for name in ("deepseek-chat", "deepseek-v3", "deepseek-ai/DeepSeek-V3")
}


class TraceConfig(_Strict):
    """The gateway's own traffic as a Mooncake-format trace (gateway/trace_recorder.py)."""

    enabled: bool = Field(
        False, description="Record from start-up (POST /admin/trace toggles it at runtime)."
    )
    path: str | None = Field(None, description="The trace file; rotated files get .1, .2, ... appended.")
    max_bytes: PositiveInt = Field(
        64 * 1024 * 1024, description="Rotate the file once it holds this many bytes."
    )
    keep_files: NonNegativeInt = Field(3, description="Rotated files kept besides the current one.")
    reorder_window_s: NonNegativeFloat = Field(
        30.0,
        description="Requests finish out of arrival order: a line is held this long so the file "
        "stays in arrival order (a later arrival is written with the latest written timestamp).",
    )
    max_pending_bytes: PositiveInt = Field(
        8 * 1024 * 1024, description="Bound on the lines held for reordering."
    )
    salt: str | None = Field(
        None,
        description="Key of the block-id and session-id hash (unset: a random key per gateway process, "
        "so recordings of two processes share no ids).",
    )

    @model_validator(mode="after")
    def _path_when_enabled(self) -> TraceConfig:
        if self.enabled and not self.path:
            raise ValueError("enabled needs a path")
        return self


class LifetimeConfig(_Strict):
    """How long blocks live in each replica's cache (gateway/cache_lifetime.py)."""

    max_tracked_blocks: PositiveInt = Field(
        262_144,
        description="Blocks whose store time (and prompt depth) is held, all replicas together; about "
        "200 bytes each.",
    )
    session_bytes: PositiveInt = Field(
        64 * 1024 * 1024,
        description="Bytes of the sessions' last-turn block keys held (8 per block); the least recently "
        "seen sessions go first.",
    )


class OperatorConfig(_Strict):
    """What the cache is worth and how long it keeps things (gateway/operator_view.py)."""

    trace: TraceConfig = Field(default_factory=TraceConfig)
    lifetime: LifetimeConfig = Field(default_factory=LifetimeConfig)
    tenant_header: str = Field("x-tenant-id", description="Request header naming the tenant.")
    max_tenants: PositiveInt = Field(64, description="Tenants counted apart; later ones count as 'other'.")
    prices: dict[str, Price] = Field(
        default_factory=dict,
        description="Per model (as the client names it): input and cached_input, USD per million prompt tokens.",
    )
    gpus_per_replica: PositiveFloat = Field(1.0, description="GPUs behind one replica (GPU-seconds saved).")

    def price_of(self, model: str) -> Price | None:
        return self.prices.get(model) or PUBLISHED_PRICES.get(model)
