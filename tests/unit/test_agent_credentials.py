"""Loading agent credentials and registration rules (gateway/agent_credentials.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gateway.agent_credentials import (
    ANY_REPLICA,
    CredentialsError,
    Identity,
    RegistrationRules,
    credentials_of,
)
from gateway.config import AuthConfig, RegistrationConfig


def test_tokens_name_their_replica_and_the_shared_one_the_rest(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text(
        f"a0 {hashlib.sha256(b'ta').hexdigest()}  # comment\n\n"
        f"a0 sha256:{hashlib.sha256(b'ta-new').hexdigest()}  # being rotated in\n"
    )
    auth = AuthConfig(agent_token_env="S", agent_tokens={"r0": "T0"}, agent_token_file=str(f))
    creds = credentials_of(auth, {"S": "shared", "T0": "t0"})
    assert creds.identify(b"t0") == Identity("r0")
    assert creds.identify(b"ta") == Identity("a0") == creds.identify(b"ta-new")
    assert creds.identify(b"shared") == Identity(ANY_REPLICA)
    assert creds.identify(b"") is None and creds.identify(b"t1") is None
    assert creds.may_speak_for(Identity(ANY_REPLICA), "x")
    assert not creds.may_speak_for(Identity(ANY_REPLICA), "r0")
    assert not creds.may_speak_for(Identity("r0"), "a0")


def test_no_credentials_means_no_auth() -> None:
    creds = credentials_of(AuthConfig(agent_token_env=None), {})
    assert not creds.required and creds.identify(b"") == Identity(ANY_REPLICA)


@pytest.mark.parametrize(
    ("tokens", "env", "line", "error"),
    [
        ({"r0": "T0"}, {}, "", "T0 is not set"),
        ({"r0": "T0", "r1": "T1"}, {"T0": "x", "T1": "x"}, "", "the same agent token"),
        ({"r0": "T0"}, {"T0": "x", "S": "x"}, "", "is the shared token"),
        ({}, {}, "a0 nothex", "expected 'REPLICA_ID SHA256_HEX_OF_TOKEN'"),
        ({}, {}, "a0 sha256:abcd", "expected 'REPLICA_ID SHA256_HEX_OF_TOKEN'"),
    ],
)
def test_bad_credentials_are_refused_at_start(
    tmp_path: Path, tokens: dict[str, str], env: dict[str, str], line: str, error: str
) -> None:
    f = tmp_path / "t.txt"
    f.write_text(line + "\n")
    auth = AuthConfig(agent_token_env="S", agent_tokens=tokens, agent_token_file=str(f))
    with pytest.raises(CredentialsError, match=error):
        credentials_of(auth, env)


def test_missing_token_file() -> None:
    with pytest.raises(CredentialsError, match="cannot read"):
        credentials_of(AuthConfig(agent_token_file="/nonexistent/kvgate"), {})


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://10.0.0.5:8000", True),
        ("http://10.0.0.5:8000/", True),
        ("http://10.0.0.5.evil.com:8000", False),
        ("http://10.0.0.1@evil.com:8000", False),
        ("http://10.0.0.5:8001", False),
        ("http://10.0.0.5:8000/other", False),
        ("http://a.replicas.svc:1234", True),
        ("http://evil.com.replicas.svc:1234", False),
        ("https://b.replicas.svc", False),  # the pattern names http
        ("http://192.168.3.3:1", True),
        ("http://192.169.3.3:1", False),
        ("http://[fd00::1]:80", True),
        ("ftp://10.0.0.5:8000", False),
    ],
)
def test_registration_rules(url: str, allowed: bool) -> None:
    config = RegistrationConfig(
        allowed_urls=["http://10.0.0.*:8000", "http://*.replicas.svc:*"],
        allowed_cidrs=["192.168.0.0/16", "fd00::/8"],
    )
    rules = RegistrationRules.of(config, lambda: {"static"})
    assert (rules.refusal("x", url) is None) == allowed
    assert rules.refusal("static", url) is None  # a configured replica's URL is not taken from a Hello
    assert RegistrationRules().refusal("x", url) is None  # no rules: any URL
