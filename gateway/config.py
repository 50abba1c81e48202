"""The gateway's one typed config tree (docs/architecture.md, "Config"), loaded from YAML and validated at
start-up.

Errors name the field path (``policy.kv_aware.balance_abs: Input should be ...``). Environment
variables prefixed ``KVGATE_`` override fields, ``__`` separating levels and values parsed as YAML
scalars: ``KVGATE_POLICY__NAME=round_robin``, ``KVGATE_INDEX__APPROXIMATE_TTL_S=30``.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.types import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from gateway.config_http import ProxyConfig, ServerConfig, _Strict
from gateway.documents import read_document
from gateway.operator_config import OperatorConfig
from router_policies.errors import UserInputError
from router_policies.prefix_index import IndexConfig
from router_policies.registry import (
    BUILTIN_POLICIES,
    PolicyConfigError,
    format_validation_error,
    validate_params,
)

ENV_PREFIX = "KVGATE_"

__all__ = [
    "ConfigError",
    "GatewayConfig",
    "ProxyConfig",
    "ServerConfig",
    "apply_env",
    "load_config",
    "parse_config",
]


class ConfigError(UserInputError):
    """The config is invalid; the message names the field path."""


def _host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return value


def _together(cert: str, key: str) -> Any:
    """A model validator: the fields ``cert`` and ``key`` (a certificate and its private key)
    are both set or both unset."""

    def check(model: BaseModel) -> BaseModel:
        if (getattr(model, cert) is None) != (getattr(model, key) is None):
            raise ValueError(f"{cert} and {key} go together")
        return model

    return model_validator(mode="after")(check)


class ListenConfig(_Strict):
    """Where the gateway listens (the CLI flags --listen and --inventory override these)."""

    http: str = Field("0.0.0.0:8000", description="HOST:PORT of the OpenAI-compatible HTTP API.")
    inventory: str = Field("0.0.0.0:50051", description="HOST:PORT of the agents' gRPC inventory stream.")

    _check = field_validator("http", "inventory")(_host_port)


class PolicyConfig(BaseModel):
    """``name`` picks the policy; a key named after a policy holds its parameters."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(
        "kv_aware", description="round_robin, least_loaded, consistent_hash, kv_aware or module:attr."
    )
    seed: int = Field(0, description="Seed of the policy's deterministic tie-breaks.")

    @model_validator(mode="after")
    def _check_params(self) -> PolicyConfig:
        extra = self.model_extra or {}
        for key, params in extra.items():
            if key not in BUILTIN_POLICIES and key != self.name:
                raise ValueError(f"unknown policy parameter block {key!r}")
            if params is not None and not isinstance(params, Mapping):
                raise ValueError(f"{key}: expected a mapping of parameters")
            try:
                validate_params(key, params, path=key)
            except PolicyConfigError as exc:
                raise ValueError(str(exc)) from None
        if self.name not in extra:
            try:
                validate_params(self.name, {}, path=self.name)
            except PolicyConfigError as exc:
                raise ValueError(str(exc)) from None
        return self

    def params_for(self, name: str | None = None) -> dict[str, Any]:
        return dict((self.model_extra or {}).get(name or self.name) or {})


class ModelConfig(_Strict):
    """One model the gateway routes; requests naming another model get 404."""

    name: str = Field(..., min_length=1, description="Model name as clients send it.")
    tokenizer: str | None = Field(
        None,
        description="Folder with tokenizer.json + tokenizer_config.json, 'remote' to ask a replica's "
        "/tokenize, or null for approximate routing on character blocks.",
    )
    block_size: PositiveInt = Field(16, description="Engine KV block size in tokens (or a multiple of it).")
    char_block_size: PositiveInt = Field(64, description="Characters per block when there is no tokenizer.")
    lora_adapters: list[str] = Field(
        default_factory=list,
        description="LoRA adapter names the replicas serve on this model; a request naming one routes "
        "in that adapter's key namespace.",
    )
    lora_fallback: Literal["any", "none"] = Field(
        "any",
        description="Where a request naming an adapter goes when no healthy replica reports it loaded "
        "(agents report each engine's adapters): 'any' replica of the model (engines that load adapters "
        "on demand), or 'none' (503 no_healthy_replica).",
    )
    chat_template: str | None = Field(
        None,
        description="Path of a Jinja chat template overriding the tokenizer folder's (as vLLM's --chat-template).",
    )
    tokenize_timeout_s: PositiveFloat = Field(2.0, description="Timeout of a remote /tokenize call.")


class ReplicaConfig(_Strict):
    """A static replica; agents may register more (inventory.allow_registration)."""

    id: str = Field(..., min_length=1, description="Replica id, unique in the fleet.")
    url: str = Field(..., description="Base URL of the engine's OpenAI API, e.g. http://10.0.0.1:8000.")
    models: list[str] = Field(default_factory=list, description="Models served (empty: all configured).")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        return v.rstrip("/")


class HealthConfig(_Strict):
    """Active health checks (GET /health) and passive ejection thresholds."""

    interval_s: PositiveFloat = Field(2.0, description="Active health check period.")
    timeout_s: PositiveFloat = Field(1.0, description="Health check timeout.")
    unhealthy_after: int = Field(2, ge=1, description="Consecutive failures that eject a replica.")
    healthy_after: int = Field(1, ge=1, description="Consecutive successes that restore it.")
    ejection_s: NonNegativeFloat = Field(
        5.0,
        description="A replica ejected because its requests failed in a row (unhealthy_after of them, "
        "e.g. first-byte timeouts while its /health still answers) stays out at least this long.",
    )
    forget_after_s: PositiveFloat = Field(
        300.0,
        description="An agent-registered replica whose agent is gone and that stays unhealthy this "
        "long leaves the fleet and the index (static replicas never do).",
    )


class SharedStateConfig(_Strict):
    """Optional Redis shared by several gateway instances."""

    redis_url: str | None = Field(None, description="Redis URL to share index and load between gateways.")
    key_prefix: str = Field("kvgate", description="Prefix of every Redis key.")
    stream_maxlen: int = Field(
        10_000, ge=16, description="Entries kept per replica's delta stream (XADD MAXLEN ~)."
    )
    publish_queue: PositiveInt = Field(
        10_000, description="Deltas waiting to be published; beyond it the oldest is dropped."
    )
    load_interval_s: PositiveFloat = Field(0.5, description="Period to publish and read in-flight load.")
    load_ttl_s: PositiveFloat = Field(
        3.0, description="An instance's published load expires this long after its last update."
    )
    reconnect_max_s: PositiveFloat = Field(5.0, description="Cap of the jittered reconnect backoff.")
    seed: int = Field(0, description="Seed of the reconnect backoff's jitter.")

    @model_validator(mode="after")
    def _ttl_outlives_interval(self) -> SharedStateConfig:
        # a load key that expires before its next refresh would make the instance's load flicker
        if self.load_ttl_s <= self.load_interval_s:
            raise ValueError("load_ttl_s must exceed load_interval_s")
        return self


class TelemetryConfig(_Strict):
    """Metrics, traces and logs."""

    metrics: bool = Field(True, description="Serve Prometheus metrics on /metrics.")
    otlp_endpoint: str | None = Field(None, description="OTLP/gRPC endpoint for traces, e.g. localhost:4317.")
    access_log: bool = Field(True, description="Structured JSON access log on stderr.")
    log_prompts: bool = Field(False, description="Include prompts in access logs.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")


class InventoryConfig(_Strict):
    """The agents' gRPC inventory stream (gateway/inventory_server.py)."""

    allow_registration: bool = Field(
        True, description="Accept agents of replicas not listed under replicas (they register themselves)."
    )
    block_bound_factor: NonNegativeFloat = Field(
        4.0,
        description="A replica may hold at most this many times the KV capacity its agent reports "
        "(never more than index.max_blocks_per_replica); 0: only the index bound.",
    )
    ack_every: PositiveInt = Field(
        1, description="Acknowledge an agent stream every N messages (acks still pending coalesce)."
    )
    ack_interval_s: NonNegativeFloat = Field(
        0.1,
        description="Least time between an ack and the stream's write before it; acks owed meanwhile "
        "coalesce (the agent only reports the position). 0: each ack at once.",
    )
    tls_cert: str | None = Field(None, description="PEM certificate to serve the stream over TLS.")
    tls_key: str | None = Field(None, description="PEM private key of tls_cert.")
    _tls_pair = _together("tls_cert", "tls_key")


class AuthConfig(_Strict):
    """Bearer tokens, read from the named environment variables (never from the file)."""

    agent_token_env: str | None = Field(
        "KVGATE_AGENT_TOKEN",
        description="Env var holding the agents' shared bearer token (unset: no auth). It may speak "
        "for any replica without a token of its own (agent_tokens, agent_token_file).",
    )
    admin_token_env: str | None = Field(
        "KVGATE_ADMIN_TOKEN", description="Env var holding the /admin bearer token (unset: no auth)."
    )
    agent_tokens: dict[str, str] = Field(
        default_factory=dict,
        description="Per-replica agent credentials: replica id -> env var holding that replica's "
        "token. A stream presenting it may only say Hello as that replica.",
    )
    agent_token_file: str | None = Field(
        None,
        description="File of per-replica credentials, one 'REPLICA_ID SHA256_HEX_OF_TOKEN' a line "
        "(# comments); read at start-up.",
    )
    registration: RegistrationConfig = Field(default_factory=lambda: RegistrationConfig())
    api_keys: ApiKeysConfig = Field(default_factory=lambda: ApiKeysConfig())
    http_tls: TlsConfig = Field(default_factory=lambda: TlsConfig())


class RegistrationConfig(_Strict):
    """Which URLs an agent may register or move an agent-registered replica to (a configured
    replica's URL never changes). Both empty: any http(s) URL."""

    allowed_urls: list[str] = Field(
        default_factory=list,
        description="Patterns SCHEME://HOST[:PORT] with shell wildcards, one host label per wildcard, "
        "e.g. 'http://10.1.*.*:8000', 'http://*.replicas.svc:*' (no user info, path or query).",
    )
    allowed_cidrs: list[str] = Field(
        default_factory=list, description="Networks the URL's host must be an IP address in, e.g. 10.0.0.0/8."
    )

    @field_validator("allowed_cidrs")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        for cidr in v:
            ipaddress.ip_network(cidr, strict=False)  # ValueError names the bad one
        return v


class ApiKeysConfig(_Strict):
    """Optional API keys on /v1/* (OpenAI-style 'Authorization: Bearer KEY') and per-key rate limits."""

    env: str | None = Field(None, description="Env var holding comma-separated API keys.")
    file: str | None = Field(None, description="File of API keys, one a line (# comments).")
    requests_per_s: NonNegativeFloat = Field(
        0.0, description="Each key's sustained request rate (0: unlimited)."
    )
    burst: NonNegativeInt = Field(
        0, description="Requests a key may send at once (0: max(1, requests_per_s))."
    )
    max_keys: PositiveInt = Field(
        10_000, description="Bound of the keys loaded (and of the rate limiter's state)."
    )


class TlsConfig(_Strict):
    """TLS on the HTTP listener (PEM files read at start-up); both unset: plaintext."""

    cert: str | None = Field(None, description="PEM certificate chain of the HTTP listener.")
    key: str | None = Field(None, description="PEM private key of cert.")
    _pair = _together("cert", "key")


AuthConfig.model_rebuild()


class GatewayConfig(_Strict):
    listen: ListenConfig = Field(default_factory=ListenConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    models: list[ModelConfig] = Field(default_factory=list)
    replicas: list[ReplicaConfig] = Field(default_factory=list)
    index: IndexConfig = Field(default_factory=IndexConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    shared_state: SharedStateConfig = Field(default_factory=SharedStateConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    inventory: InventoryConfig = Field(default_factory=InventoryConfig)
    operator: OperatorConfig = Field(default_factory=OperatorConfig)  # gateway/operator_config.py

    @model_validator(mode="after")
    def _cross_checks(self) -> GatewayConfig:
        ids = [r.id for r in self.replicas]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"replicas: duplicate id {dup[0]!r}")
        names = {m.name for m in self.models}
        if len(names) != len(self.models):
            raise ValueError("models: duplicate model name")
        for i, r in enumerate(self.replicas):
            for m in r.models:
                if m not in names:
                    raise ValueError(f"replicas.{i}.models: unknown model {m!r}")
        return self


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def apply_env(tree: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    out = dict(tree)
    skip = {ENV_PREFIX + "AGENT_TOKEN", ENV_PREFIX + "ADMIN_TOKEN"}
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name in skip:
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not path or path[0] not in GatewayConfig.model_fields:
            continue
        _set_path(out, path, yaml.safe_load(raw) if raw else None)
    return out


def parse_config(data: Any, source: str = "config") -> GatewayConfig:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return GatewayConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(f"{source}: {format_validation_error(exc, '')}") from None


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """Load, override from ``KVGATE_*`` environment variables and validate."""
    p = Path(path)
    data = read_document(p, "YAML", lambda why: ConfigError(f"{p}: {why}"))
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{p}: the top level must be a mapping")
    tree = apply_env(dict(data or {}), os.environ if env is None else env)
    config = parse_config(tree, str(p))
    if not config.models:
        # every request would get 404 model_not_found: a truncated or wrong file, not a config
        raise ConfigError(f"{p}: models: the config defines no model (an empty or truncated file?)")
    return config
