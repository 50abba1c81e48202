"""TLS on the gateway's HTTP listener (docs/gateway.md, "TLS"; docs/architecture.md, the
composition root builds it once at start-up).

The certificate chain and key are read when the listener starts; replacing them needs a restart
(``auth`` is a restart-only section). TLS 1.2 is the oldest version offered, as Envoy's default.
"""

from __future__ import annotations

import ssl

from gateway.config import TlsConfig
from router_policies.errors import UserInputError


def http_ssl_context(config: TlsConfig) -> ssl.SSLContext | None:
    """The server context of ``auth.http_tls``, or None when TLS is off (raises UserInputError
    naming the file that cannot be loaded)."""
    if config.cert is None or config.key is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.cert, config.key)
    except (OSError, ssl.SSLError) as exc:
        raise UserInputError(
            f"auth.http_tls: cannot load cert {config.cert} / key {config.key}: {exc}"
        ) from None
    return ctx
