"""Who may speak for which replica on the inventory stream (docs/architecture.md, the inventory
path; docs/gateway.md, "Agent credentials").

Two parts, both fixed at start-up and immutable:

* ``AgentCredentials``: which bearer token speaks for which replica. A per-replica token (from
  ``auth.agent_tokens`` or ``auth.agent_token_file``) may say Hello only as its replica; the shared
  token (``auth.agent_token_env``) may say Hello as any replica that has no token of its own. With
  neither, streams are not authenticated.
* ``RegistrationRules``: the URLs an agent may register a replica at, or move an agent-registered
  replica to. A configured (static) replica's URL comes from the config and is never taken from a
  Hello (``Fleet.agent_hello``), so the rules do not apply to it.

Why bearer tokens per replica rather than mTLS with the replica id in the certificate: the agents
already send a bearer token and the gateway already checks one, the Helm chart already mounts one
Secret per gateway; per-replica tokens add one Secret entry per replica and no PKI (a CA, issuance
and rotation, SAN parsing in grpc.aio, which exposes the peer certificate only through
``auth_context``). mTLS can be layered on later: the identity check is one function of (presented
credential, replica id).

Invariants
* Tokens are kept only as SHA-256 digests. A presented token is hashed and looked up by digest:
  the lookup's timing depends on the digest, which a client cannot steer, never on the token.
* Two replicas never share a token (refused at start-up): a token names at most one replica. A
  replica may have several tokens (rotation).
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

from gateway.config import AuthConfig, GatewayConfig, RegistrationConfig
from gateway.documents import read_text
from router_policies.errors import UserInputError

log = logging.getLogger("kvgate.auth")

ANY_REPLICA = None  # what the shared token speaks for


class CredentialsError(UserInputError):
    """The credentials cannot be loaded (a missing env var, a malformed file line)."""


def token_digest(token: str | bytes) -> bytes:
    raw = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(raw).digest()


@dataclass(frozen=True, slots=True)
class Identity:
    """What a stream's token allows: ``replica`` (one id) or ``ANY_REPLICA`` (the shared token)."""

    replica: str | None


@dataclass(frozen=True, slots=True)
class AgentCredentials:
    """``shared``: digest of the shared token (None: none). ``per_replica``: token digest ->
    replica id. Both empty: no authentication."""

    shared: bytes | None = None
    per_replica: Mapping[bytes, str] = field(default_factory=dict)

    @classmethod
    def shared_only(cls, token: str | None) -> AgentCredentials:
        return cls(shared=token_digest(token) if token else None)

    @property
    def required(self) -> bool:
        return self.shared is not None or bool(self.per_replica)

    @property
    def bound_replicas(self) -> frozenset[str]:
        """Replicas with a token of their own: the shared token cannot speak for them."""
        return frozenset(self.per_replica.values())

    def identify(self, presented: bytes) -> Identity | None:
        """The identity of a presented token, or None when it is no valid credential."""
        if not self.required:
            return Identity(ANY_REPLICA)
        digest = token_digest(presented)
        replica = self.per_replica.get(digest)
        if replica is not None:
            return Identity(replica)
        if self.shared is not None and presented and hmac.compare_digest(digest, self.shared):
            return Identity(ANY_REPLICA)
        return None

    def may_speak_for(self, identity: Identity, replica: str) -> bool:
        if identity.replica is ANY_REPLICA:
            return replica not in self.bound_replicas
        return identity.replica == replica


def _read_token_file(path: str) -> list[tuple[str, bytes]]:
    """``REPLICA_ID SHA256_HEX`` lines -> (replica, digest); a replica may have several lines (a
    token being rotated: the old and the new one both valid until the old line goes)."""
    text = read_text(Path(path), lambda why: CredentialsError(f"auth.agent_token_file: {path}: {why}"))
    out: list[tuple[str, bytes]] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        digest_hex = parts[-1].removeprefix("sha256:") if len(parts) == 2 else ""
        try:
            digest = bytes.fromhex(digest_hex)
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise CredentialsError(f"{path}:{n}: expected 'REPLICA_ID SHA256_HEX_OF_TOKEN'")
        out.append((parts[0], digest))
    return out


def credentials_of(auth: AuthConfig, env: Mapping[str, str]) -> AgentCredentials:
    """The credentials ``auth`` names, tokens read from ``env`` (raises ``CredentialsError``)."""
    shared = env.get(auth.agent_token_env) if auth.agent_token_env else None
    digests: list[tuple[str, bytes]] = []
    for replica, var in sorted(auth.agent_tokens.items()):
        token = env.get(var)
        if not token:
            raise CredentialsError(f"auth.agent_tokens.{replica}: environment variable {var} is not set")
        digests.append((replica, token_digest(token)))
    if auth.agent_token_file:
        digests += _read_token_file(auth.agent_token_file)
    per_replica: dict[bytes, str] = {}
    for replica, digest in digests:
        other = per_replica.setdefault(digest, replica)
        if other != replica:
            raise CredentialsError(f"auth: replicas {other!r} and {replica!r} have the same agent token")
    shared_digest = token_digest(shared) if shared else None
    if shared_digest is not None and shared_digest in per_replica:
        raise CredentialsError(f"auth: replica {per_replica[shared_digest]!r}'s token is the shared token")
    return AgentCredentials(shared=shared_digest, per_replica=per_replica)


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _url_parts(url: str) -> tuple[str, str, str] | None:
    """``(scheme, host, port)`` of a replica base URL, or None for anything else: a URL with
    user info, a path, a query or a fragment is never a replica's base URL."""
    try:
        parts = urlsplit(url.rstrip("/"))
        port = parts.port
    except ValueError:
        return None
    host = (parts.hostname or "").lower()
    if parts.scheme not in _DEFAULT_PORTS or not host or "@" in parts.netloc:
        return None
    if parts.path or parts.query or parts.fragment:
        return None
    return parts.scheme, host, str(port) if port is not None else _DEFAULT_PORTS[parts.scheme]


def _pattern_matches(pattern: str, scheme: str, host: str, port: str) -> bool:
    """``SCHEME://HOST[:PORT]`` with shell wildcards, one host label per pattern label (so
    ``*.replicas.svc`` never matches ``evil.com.replicas.svc`` nor ``10.0.0.*`` ``10.0.0.5.evil.com``);
    a missing port is the scheme's default, ``*`` any port."""
    p_scheme, sep, rest = pattern.partition("://")
    p_host, _, p_port = rest.partition(":")
    if (
        not sep
        or p_scheme != scheme
        or not fnmatch.fnmatchcase(port, p_port or _DEFAULT_PORTS.get(scheme, ""))
    ):
        return False
    labels, p_labels = host.split("."), p_host.lower().split(".")
    return len(labels) == len(p_labels) and all(map(fnmatch.fnmatchcase, labels, p_labels))


@dataclass(frozen=True, slots=True)
class RegistrationRules:
    """``urls``: patterns ``SCHEME://HOST[:PORT]`` (``_pattern_matches``); ``cidrs``: networks an
    IP host must be in. A URL is allowed when it matches a pattern or its host is an address in a
    network (names are never resolved here); both empty: any URL. ``static``: the ids of the
    configured replicas now (their URL is never taken from a Hello, so it is not checked)."""

    urls: tuple[str, ...] = ()
    cidrs: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    static: Callable[[], Collection[str]] = frozenset

    @classmethod
    def of(
        cls, config: RegistrationConfig, static: Callable[[], Collection[str]] = frozenset
    ) -> RegistrationRules:
        nets = tuple(ipaddress.ip_network(c, strict=False) for c in config.allowed_cidrs)
        return cls(tuple(config.allowed_urls), nets, static)

    @property
    def restricted(self) -> bool:
        return bool(self.urls or self.cidrs)

    def refusal(self, replica: str, url: str) -> str | None:
        """Why a Hello of ``replica`` at ``url`` may not (re)register it, or None."""
        if not self.restricted or replica in self.static():
            return None
        parts = _url_parts(url)
        if parts is not None:
            scheme, host, port = parts
            if any(_pattern_matches(p, scheme, host, port) for p in self.urls):
                return None
            try:
                addr = ipaddress.ip_address(host.strip("[]"))
            except ValueError:
                addr = None
            if addr is not None and any(addr in net for net in self.cidrs):
                return None
        return f"url {url!r} is not allowed by auth.registration (allowed_urls, allowed_cidrs)"


class StreamAccess(NamedTuple):
    """Who may speak for which replica, and at which URLs replicas may register."""

    credentials: AgentCredentials
    registration: RegistrationRules


def stream_access_of(
    config: GatewayConfig, env: Mapping[str, str], static: Callable[[], Collection[str]]
) -> StreamAccess:
    """The inventory stream's access rules from the config (raises ``CredentialsError``). Warns
    when a token holder may register a replica at any URL (and so receive client prompts)."""
    auth = config.auth
    access = StreamAccess(credentials_of(auth, env), RegistrationRules.of(auth.registration, static))
    if config.inventory.allow_registration and not access.registration.restricted:
        creds = access.credentials
        who = "any agent token" if creds.required else "any client of the inventory port"
        log.warning(
            "inventory.allow_registration is on and auth.registration sets no allowed_urls or "
            "allowed_cidrs: %s may register a replica at any URL and receive client prompts",
            who,
        )
    return access
