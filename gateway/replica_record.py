"""One replica as the gateway holds it (docs/architecture.md, "Fleet"): parts split by their one
writer.

=============  ====================================  ==========================================
part           what                                  its only writer
=============  ====================================  ==========================================
``identity``   id, url, models, static, engine       ``Fleet`` (config reload, agent hello)
``link``       agent connected / degraded / shared   ``Fleet`` (agent streams, shared state)
``health``     the health state machine              ``ReplicaHealth``'s methods, via ``Fleet``
``flights``    this gateway's in-flight load         ``placement.Flight``
``engine``     the engine's running / waiting / KV   ``Fleet`` (agent load, shared state)
``remote``     other instances' in-flight load       ``Fleet.apply_remote_load``
``audit``      prediction-audit statistics           ``AuditStats.record``
``ttft_audit`` TTFT predicted against observed        ``TtftAuditStats.record`` (the TTFT feed)
``ttft_model`` the fitted TTFT model, as last exported  ``Fleet`` (the TTFT feed's listener)
=============  ====================================  ==========================================

The flat names other modules read (``rec.healthy``, ``rec.in_flight_requests``, ...) are
read-only properties over those parts.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from gateway.replica_audit import AuditStats, TtftAuditStats
from gateway.replica_health import ReplicaHealth
from gateway.replica_identity import AgentLink, ReplicaIdentity
from gateway.replica_load import NO_REMOTE_LOAD, EngineLoad, RemoteLoad, combined_load
from router_policies.placement import FlightCounters, ReplicaLoad
from router_policies.ttft.params import COEFFICIENTS, TtftParams


def _read(path: str) -> Any:
    """A read-only attribute of a record, read through one of its parts (``"identity.id"``): a
    property over a C-level ``attrgetter``, as cheap as an attribute lookup can be through a part
    (the request path reads these several times per request)."""
    return property(attrgetter(path))


class ReplicaRecord:
    __slots__ = (
        "audit",
        "engine_load",
        "flights",
        "health",
        "identity",
        "link",
        "remote",
        "ttft_audit",
        "ttft_model",
    )

    def __init__(self, identity: ReplicaIdentity) -> None:
        self.identity = identity
        self.link = AgentLink()
        self.health = ReplicaHealth()
        self.flights = FlightCounters()
        self.engine_load = EngineLoad()
        self.remote: RemoteLoad = NO_REMOTE_LOAD
        self.audit = AuditStats()
        self.ttft_audit = TtftAuditStats()
        self.ttft_model: TtftParams | None = None  # None: no first token fitted yet

    id: str = _read("identity.id")
    url: str = _read("identity.url")
    models: frozenset[str] = _read("identity.models")
    static: bool = _read("identity.static")
    agent_connected: bool = _read("link.connected")
    healthy: bool = _read("health.healthy")
    in_flight_requests: int = _read("flights.requests")
    in_flight_tokens: int = _read("flights.tokens")
    pending_prefill_tokens: int = _read("flights.pending_prefill_tokens")
    requests: int = _read("flights.started")
    engine_running: int = _read("engine_load.running")
    engine_waiting: int = _read("engine_load.waiting")
    kv_usage: float = _read("engine_load.kv_usage")

    def serves(self, model: str) -> bool:
        return self.identity.serves(model)

    def load(self) -> ReplicaLoad:
        return combined_load(self.flights, self.remote, self.engine_load)

    def describe(self) -> dict[str, object]:
        ident, link, flights, engine = self.identity, self.link, self.flights, self.engine_load
        return {
            "id": ident.id,
            "url": ident.url,
            "models": sorted(ident.models),
            "source": "static" if ident.static else "agent",
            "agent_connected": link.connected,
            "index_degraded": link.degraded,
            "engine": ident.engine,
            "block_size": ident.block_size,
            "hybrid": ident.hybrid,
            "lora_adapters": None if ident.adapters is None else sorted(ident.adapters),
            "healthy": self.health.healthy,
            "last_error": self.health.last_error,
            "in_flight_requests": flights.requests,
            "in_flight_tokens": flights.tokens,
            "pending_prefill_tokens": flights.pending_prefill_tokens,
            "engine_running": engine.running,
            "engine_waiting": engine.waiting,
            "kv_usage": engine.kv_usage,
            "requests": flights.started,
            "failures": self.health.failures,
            "remote_in_flight_requests": self.remote.requests,
            "remote_in_flight_tokens": self.remote.tokens,
            "shared_inventory": link.shared,
            "prediction_audit": {
                "total": self.audit.total,
                "exact": self.audit.exact,
                "exact_fraction": self.audit.exact_fraction,
                "inexact_causes": dict(self.audit.causes),
            },
            "ttft_audit": {
                "total": self.ttft_audit.total,
                "median_abs_error": self.ttft_audit.median_abs_error(),
                "model": _model_of(self.ttft_model),
            },
        }


def _model_of(params: TtftParams | None) -> dict[str, float] | None:
    if params is None:
        return None
    out = {name: round(value, 6) for name, value in zip(COEFFICIENTS, params.coefficients(), strict=True)}
    out.update(
        observations=params.observations,
        error_ratio=round(params.error_ratio, 4),
        calibration=round(params.calibration, 4),  # the factor on every fitted term (ttft/model.py)
        kv_capacity_tokens=params.kv_capacity_tokens,
    )
    return out
