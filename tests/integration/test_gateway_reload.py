"""Config at start-up and reload (``POST /admin/reload`` and SIGHUP) on a real gateway process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any

import yaml

from tests.integration.gateway_harness import REPO, Gateway, Procs, base_config, http
from tests.polling import wait_until

JSON = {"content-type": "application/json"}
REQ = json.dumps({"model": "m", "prompt": "hello"}).encode()


def _policy(gw: Gateway) -> str:
    status, doc = gw.admin("POST", "/admin/explain", REQ)
    assert status == 200, doc
    name: str = doc["policy"]
    return name


def _rewrite(gw: Gateway, cfg: dict[str, Any] | str) -> None:
    gw.config_path.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg))


def test_valid_reload_swaps_policy_and_settings(procs: Procs) -> None:
    b = procs.backend("r0")
    cfg = base_config(b)
    gw = procs.gateway(cfg)
    assert _policy(gw) == "round_robin"
    assert "x-kvgate-replica" in http("POST", gw.url + "/v1/completions", REQ, JSON)[1]
    _rewrite(gw, {**cfg, "policy": {"name": "least_loaded"}, "proxy": {"debug_headers": False}})
    status, doc = gw.admin("POST", "/admin/reload")
    assert (status, doc) == (200, {"status": "reloaded", "policy": "least_loaded"})
    assert _policy(gw) == "least_loaded"
    assert "x-kvgate-replica" not in http("POST", gw.url + "/v1/completions", REQ, JSON)[1]
    assert 'kvgate_config_reloads_total{result="applied"} 1.0' in gw.metrics()


def test_reload_adds_and_removes_static_replicas(procs: Procs) -> None:
    r0, r1 = procs.backend("r0"), procs.backend("r1")
    cfg = base_config(r0)
    gw = procs.gateway(cfg)
    assert set(gw.replicas()) == {"r0"}
    _rewrite(gw, base_config(r1))
    assert gw.admin("POST", "/admin/reload")[0] == 200
    assert set(gw.replicas()) == {"r1"}
    wait_until(lambda: gw.replicas()["r1"]["healthy"], what="r1 checked healthy")
    assert http("POST", gw.url + "/v1/completions", REQ, JSON)[1]["x-kvgate-replica"] == "r1"


def test_invalid_reload_is_rejected_and_the_running_config_stays(procs: Procs) -> None:
    b = procs.backend("r0")
    cfg = base_config(b)
    gw = procs.gateway(cfg)
    cases: list[tuple[dict[str, Any] | str, str]] = [
        (
            {**cfg, "policy": {"name": "kv_aware", "kv_aware": {"balance_abs": -1}}},
            "policy.kv_aware.balance_abs",
        ),
        ({**cfg, "proxy": {"retrys": 3}}, "proxy.retrys"),
        ({**cfg, "policy": {"name": "no_such_policy"}}, "no_such_policy"),
        ("listen: [unclosed", "invalid YAML"),
    ]
    for bad, named in cases:
        _rewrite(gw, bad)
        status, doc = gw.admin("POST", "/admin/reload")
        assert status == 400, doc
        assert doc["error"]["code"] == "invalid_config"
        assert named in doc["error"]["message"]
        assert _policy(gw) == "round_robin"
        assert http("POST", gw.url + "/v1/completions", REQ, JSON)[0] == 200
    assert 'kvgate_config_reloads_total{result="rejected"} 4.0' in gw.metrics()


def test_sighup_reloads_and_an_invalid_file_is_kept_out(procs: Procs) -> None:
    b = procs.backend("r0")
    cfg = base_config(b)
    gw = procs.gateway(cfg)
    _rewrite(gw, {**cfg, "policy": {"name": "consistent_hash"}})
    gw.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: _policy(gw) == "consistent_hash", what="SIGHUP reload")
    _rewrite(gw, {**cfg, "policy": {"name": "kv_aware", "kv_aware": {"min_match_ratio": 7}}})
    gw.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "config reload rejected" in gw.stderr(), what="rejection logged")
    assert "policy.kv_aware.min_match_ratio" in gw.stderr()
    assert _policy(gw) == "consistent_hash"
    assert gw.proc.poll() is None


def test_admin_endpoints_need_the_token(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    for method, path in [("POST", "/admin/reload"), ("GET", "/admin/replicas"), ("GET", "/admin/index")]:
        status, _, body = http(method, gw.url + path, b"" if method == "POST" else None)
        assert status == 401
        assert json.loads(body)["error"]["type"] == "authentication_error"
        status, _, _ = http(
            method, gw.url + path, b"" if method == "POST" else None, {"authorization": "Bearer wrong"}
        )
        assert status == 401


def test_env_overrides_apply_at_start(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b), env={"KVGATE_POLICY__NAME": "least_loaded"})
    assert _policy(gw) == "least_loaded"


def test_invalid_config_at_start_names_the_field(procs: Procs) -> None:
    path = procs.write_config({"proxy": {"retries": -1}, "replicas": [{"id": "a", "url": "ftp://x"}]})
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 2
    assert "proxy.retries" in out.stderr and "replicas.0.url" in out.stderr
    assert "Traceback" not in out.stderr
