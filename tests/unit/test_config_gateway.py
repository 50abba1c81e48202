"""The gateway config tree: defaults, field-path errors, KVGATE_ overrides, file loading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config import ConfigError, GatewayConfig, apply_env, load_config, parse_config


def test_defaults_are_a_valid_config() -> None:
    cfg = parse_config({})
    assert isinstance(cfg, GatewayConfig)
    assert cfg.policy.name == "kv_aware"
    assert cfg.proxy.retries == 2 and cfg.proxy.debug_headers is True
    assert cfg.telemetry.log_prompts is False


@pytest.mark.parametrize(
    ("tree", "path"),
    [
        ({"policy": {"name": "kv_aware", "kv_aware": {"balance_abs": -1}}}, "policy.kv_aware.balance_abs"),
        ({"proxy": {"retries": -1}}, "proxy.retries"),
        ({"proxy": {"retrys": 1}}, "proxy.retrys"),
        ({"replicas": [{"id": "a", "url": "ftp://h"}]}, "replicas.0.url"),
        ({"listen": {"http": "nowhere"}}, "listen.http"),
        ({"health": {"unhealthy_after": 0}}, "health.unhealthy_after"),
        ({"index": {"max_blocks_per_replica": 0}}, "index.max_blocks_per_replica"),
        ({"telemetry": {"log_level": "LOUD"}}, "telemetry.log_level"),
    ],
)
def test_errors_name_the_field_path(tree: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(tree)
    assert path in str(err.value)


def test_cross_checks() -> None:
    with pytest.raises(ConfigError, match="duplicate id 'a'"):
        parse_config({"replicas": [{"id": "a", "url": "http://x"}, {"id": "a", "url": "http://y"}]})
    with pytest.raises(ConfigError, match=r"replicas\.0\.models: unknown model 'zz'"):
        parse_config(
            {"models": [{"name": "m"}], "replicas": [{"id": "a", "url": "http://x", "models": ["zz"]}]}
        )
    with pytest.raises(ConfigError, match="unknown policy"):
        parse_config({"policy": {"name": "nope"}})


def test_env_overrides_by_path_with_yaml_scalars() -> None:
    env = {
        "KVGATE_POLICY__NAME": "round_robin",
        "KVGATE_INDEX__APPROXIMATE_TTL_S": "30",
        "KVGATE_PROXY__DEBUG_HEADERS": "false",
        "KVGATE_ADMIN_TOKEN": "secret",  # a token, not a config field
        "KVGATE_NOT_A_SECTION": "1",
        "OTHER": "x",
    }
    cfg = parse_config(apply_env({"policy": {"name": "kv_aware"}}, env))
    assert cfg.policy.name == "round_robin"
    assert cfg.index.approximate_ttl_s == 30.0
    assert cfg.proxy.debug_headers is False


def test_env_override_errors_name_the_field(tmp_path: Path) -> None:
    p = tmp_path / "gw.yaml"
    p.write_text("models: [{name: m}]\nproxy: {retries: 1}\n")
    with pytest.raises(ConfigError, match=r"proxy\.retries"):
        load_config(p, env={"KVGATE_PROXY__RETRIES": "many"})
    assert load_config(p, env={"KVGATE_PROXY__RETRIES": "4"}).proxy.retries == 4


def test_load_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad, env={})
    top = tmp_path / "top.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(top, env={})


@pytest.mark.parametrize("text", ["", "# nothing\n", "models: []\n", "policy: {name: round_robin}\n"])
def test_a_config_without_models_is_refused(tmp_path: Path, text: str) -> None:
    # issue 13 finding 4: an empty file was accepted, then every request got 404 model_not_found
    p = tmp_path / "gw.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match="models: the config defines no model"):
        load_config(p, env={})
    p.write_text(text + "models: [{name: m}]\n" if "models" not in text else "models: [{name: m}]\n")
    assert [m.name for m in load_config(p, env={}).models] == ["m"]


@pytest.mark.parametrize(
    ("config", "where", "message"),
    [
        ({"inventory": {"tls_cert": "c.pem"}}, "inventory", "tls_cert and tls_key go together"),
        ({"inventory": {"tls_key": "k.pem"}}, "inventory", "tls_cert and tls_key go together"),
        ({"auth": {"http_tls": {"cert": "c.pem"}}}, "http_tls", "cert and key go together"),
        ({"auth": {"http_tls": {"key": "k.pem"}}}, "http_tls", "cert and key go together"),
    ],
)
def test_a_certificate_and_its_key_go_together(config: dict[str, Any], where: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_config({"models": [{"name": "m"}], **config})
    assert where in str(err.value)
    both = parse_config(
        {
            "models": [{"name": "m"}],
            "inventory": {"tls_cert": "c.pem", "tls_key": "k.pem"},
            "auth": {"http_tls": {"cert": "c.pem", "key": "k.pem"}},
        }
    )
    assert both.inventory.tls_key == "k.pem" and both.auth.http_tls.key == "k.pem"


def test_the_featurizer_reads_each_of_its_settings_from_its_own_config_field() -> None:
    """``encode_settings`` maps by name: every setting comes from a distinct proxy field."""
    import dataclasses

    from gateway.config_http import ProxyConfig
    from gateway.features.featurizer import encode_settings

    names = [
        n for n in ProxyConfig.model_fields if n.startswith("tokenize_") or n.endswith(("_chars", "_bytes"))
    ]
    values = {n: 1000 + i for i, n in enumerate(names)}  # a distinct value per field
    s = encode_settings(ProxyConfig(**values))
    read = [getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "budgets"]
    read += [getattr(s.budgets, f.name) for f in dataclasses.fields(s.budgets)]
    assert len(set(read)) == len(read) and set(read) <= set(values.values())
    assert s.threads == values["tokenize_threads"] and s.defer_chars == values["tokenize_defer_chars"]
    assert s.budgets.cache_bytes == values["tokenize_cache_bytes"]
    assert s.budgets.max_prompt_chars == values["max_prompt_chars"]
    assert s.budgets.memo_cache_bytes == values["memo_cache_bytes"]
