"""Optional API keys and per-key rate limits on the OpenAI API (docs/gateway.md, "API keys and
rate limits"): an aiohttp middleware the composition root (gateway/app.py) registers after the
OpenAI-errors middleware.

Only ``/v1/*`` is guarded; ``/health``, ``/ready`` and ``/metrics`` stay open (probes and
scrapers), ``/admin`` has its own token. A request is checked before its body is read.

Invariants
* Keys are kept only as SHA-256 digests, each with a short public id (``key-`` and 8 hex digits
  of the digest) for logs. A presented key is hashed and looked up by digest: timing depends on
  the digest, which a client cannot steer (``ApiKeys.identify``).
* Bounded memory: at most ``auth.api_keys.max_keys`` keys (refused at start-up beyond), one rate
  bucket per key (gateway/rate_limit.py); metrics are labelled by reason only, never by key.
* Every refusal is an OpenAI error document: 401 ``invalid_api_key`` (with
  ``WWW-Authenticate: Bearer``), 429 ``rate_limit_exceeded`` with ``Retry-After`` in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.agent_credentials import token_digest
from gateway.config import ApiKeysConfig
from gateway.documents import read_text
from gateway.openai_errors import RequestError, error_response_of
from gateway.rate_limit import TokenBuckets
from router_policies.errors import UserInputError

GUARDED_PREFIX = "/v1/"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiKeysError(UserInputError):
    """The API keys cannot be loaded (an unreadable file, too many keys, no key at all)."""


def key_id(digest: bytes) -> str:
    return "key-" + digest.hex()[:8]


def _read_keys(config: ApiKeysConfig, env: Mapping[str, str]) -> list[str]:
    keys: list[str] = []
    if config.env:
        keys += [k.strip() for k in env.get(config.env, "").split(",") if k.strip()]
    if config.file:
        file = config.file
        text = read_text(Path(file), lambda why: ApiKeysError(f"auth.api_keys.file: {file}: {why}"))
        keys += [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return [k for k in keys if k]


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """Digest -> public key id."""

    ids: Mapping[bytes, str]

    @classmethod
    def of(cls, config: ApiKeysConfig, env: Mapping[str, str]) -> ApiKeys | None:
        """The configured keys; None when API keys are off (neither env nor file set)."""
        if not config.env and not config.file:
            return None
        keys = _read_keys(config, env)
        if not keys:
            raise ApiKeysError(
                f"auth.api_keys: no key found in {config.env or ''} {config.file or ''}".strip()
            )
        digests = {token_digest(k) for k in keys}
        if len(digests) > config.max_keys:
            raise ApiKeysError(f"auth.api_keys: {len(digests)} keys, more than max_keys={config.max_keys}")
        return cls({d: key_id(d) for d in digests})

    def identify(self, presented: str) -> str | None:
        """The public id of a presented key, or None. The lookup compares digests, never the
        key itself: its timing can reveal at most how a digest begins, which an attacker cannot
        turn into a key (a dict of digests rather than a scan with ``hmac.compare_digest`` over
        every key, whose cost would grow with ``max_keys`` on every request)."""
        return self.ids.get(token_digest(presented))


class ApiAuthMetrics:
    def __init__(self, registry: CollectorRegistry, keys: int) -> None:
        self.refused = Counter(
            "kvgate_api_requests_refused",
            "OpenAI API requests refused before routing, by reason (missing_key, invalid_key, rate_limited)",
            ["reason"],
            registry=registry,
        )
        self.keys = Gauge("kvgate_api_keys", "API keys loaded", registry=registry)
        self.keys.set(keys)


def _unauthorized(message: str) -> web.Response:
    resp = error_response_of(
        RequestError(message, status=401, code="invalid_api_key", type="invalid_request_error")
    )
    resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


def _presented_key(request: web.Request) -> str | None:
    value = request.headers.get("Authorization", "")
    scheme, _, key = value.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


class ApiAuth:
    """The middleware: authenticates ``/v1/*`` requests, then takes a token of the key's bucket."""

    def __init__(self, keys: ApiKeys, buckets: TokenBuckets | None, metrics: ApiAuthMetrics) -> None:
        self.keys = keys
        self.buckets = buckets
        self.metrics = metrics

    @web.middleware
    async def middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        if not request.path.startswith(GUARDED_PREFIX):
            return await handler(request)
        presented = _presented_key(request)
        if presented is None:
            self.metrics.refused.labels("missing_key").inc()
            return _unauthorized(
                "You didn't provide an API key. Send it in the Authorization header: 'Authorization: Bearer KEY'."
            )
        kid = self.keys.identify(presented)
        if kid is None:
            self.metrics.refused.labels("invalid_key").inc()
            return _unauthorized("Incorrect API key provided.")
        wait = self.buckets.take(kid) if self.buckets is not None else 0.0
        if wait > 0:
            self.metrics.refused.labels("rate_limited").inc()
            b = self.buckets
            assert b is not None
            resp = error_response_of(
                RequestError(
                    f"Rate limit reached for {kid}: {b.rate:g} requests/s, burst {b.burst}. "
                    f"Please try again in {wait:.3f}s.",
                    status=429,
                    code="rate_limit_exceeded",
                )
            )
            resp.headers["Retry-After"] = str(max(1, math.ceil(wait)))
            return resp
        return await handler(request)


def api_auth_middlewares(
    config: ApiKeysConfig, env: Mapping[str, str], registry: CollectorRegistry
) -> list[Middleware]:
    """``[middleware]`` when API keys are configured, else ``[]`` (raises ``ApiKeysError``)."""
    keys = ApiKeys.of(config, env)
    if keys is None:
        return []
    buckets = None
    if config.requests_per_s > 0:
        burst = config.burst or max(1, math.ceil(config.requests_per_s))
        buckets = TokenBuckets(config.requests_per_s, burst, max_keys=len(keys.ids))
    return [ApiAuth(keys, buckets, ApiAuthMetrics(registry, len(keys.ids))).middleware]
