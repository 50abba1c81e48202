"""The chart with the gateway's HTTP API over TLS (``gateway.config.auth.http_tls``): probes and
the ServiceMonitor switch to HTTPS; without it they stay HTTP (the default, left unwritten)."""

from __future__ import annotations

from typing import Any

from tests.deploy.conftest import gateway_container, render

TLS = {"cert": "/etc/kvgate/http-tls/tls.crt", "key": "/etc/kvgate/http-tls/tls.key"}


def _values(auth: dict[str, Any]) -> dict[str, Any]:
    return {
        "gateway": {"config": {"models": [{"name": "m"}], "auth": auth}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    }


def _schemes(auth: dict[str, Any]) -> tuple[set[str], str | None]:
    r = render(_values(auth))
    c = gateway_container(r)
    probes = {
        c[p]["httpGet"].get("scheme", "HTTP") for p in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    (monitor,) = r.of_kind("ServiceMonitor")
    return probes, monitor["spec"]["endpoints"][0].get("scheme")


def test_probes_and_monitor_follow_http_tls() -> None:
    assert _schemes({"http_tls": TLS}) == ({"HTTPS"}, "https")
    assert _schemes({}) == ({"HTTP"}, None)
