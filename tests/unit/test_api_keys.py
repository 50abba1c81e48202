"""API keys loading and the per-key token buckets (gateway/api_keys.py, gateway/rate_limit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.api_keys import ApiKeys, ApiKeysError, api_auth_middlewares
from gateway.config import ApiKeysConfig
from gateway.rate_limit import TokenBuckets


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_burst_refill_and_retry_after() -> None:
    clock = Clock()
    b = TokenBuckets(rate=2.0, burst=3, max_keys=2, clock=clock)
    assert [b.take("k") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take("k") == pytest.approx(0.5)  # one token in 1/rate s
    assert b.take("k") == pytest.approx(0.5)  # a refusal takes nothing
    clock.now += 0.5
    assert b.take("k") == 0.0 and b.take("k") > 0
    assert b.take("other") == 0.0  # its own bucket
    clock.now += 1000
    assert [b.take("k") for _ in range(4)][-1] > 0  # refill is capped at the burst
    with pytest.raises(RuntimeError):
        b.take("third")  # bounded: never more buckets than keys
    assert len(b) == 2


def test_keys_from_env_and_file_hashed(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("sk-1  # comment\n\nsk-2\n")
    keys = ApiKeys.of(ApiKeysConfig(env="K", file=str(f)), {"K": "sk-3,,sk-1"})
    assert keys is not None and len(keys.ids) == 3
    assert all(len(d) == 32 for d in keys.ids)  # digests, never the keys
    assert keys.identify("sk-2") is not None and keys.identify("sk-4") is None
    assert keys.identify("sk-1") != keys.identify("sk-3")


def test_off_unless_configured_and_bad_configs_refused(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    assert api_auth_middlewares(ApiKeysConfig(), {}, registry) == []
    with pytest.raises(ApiKeysError, match="no key found"):
        ApiKeys.of(ApiKeysConfig(env="K"), {})
    with pytest.raises(ApiKeysError, match="cannot read"):
        ApiKeys.of(ApiKeysConfig(file=str(tmp_path / "missing")), {})
    with pytest.raises(ApiKeysError, match="more than max_keys=1"):
        ApiKeys.of(ApiKeysConfig(env="K", max_keys=1), {"K": "a,b"})


def test_tls_files_that_cannot_load_are_refused(tmp_path: Path) -> None:
    from gateway.config import TlsConfig
    from gateway.tls import http_ssl_context
    from router_policies.errors import UserInputError

    assert http_ssl_context(TlsConfig()) is None
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(UserInputError, match=r"auth\.http_tls: cannot load"):
        http_ssl_context(TlsConfig(cert=str(bad), key=str(bad)))
