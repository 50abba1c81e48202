"""A small blocking JSON-over-HTTP client for the harness (stdlib only, so it runs in any venv).

Requests in the harness are sent one at a time on purpose: the cached-token prediction check
compares the gateway's prediction with the engine's answer for the same request, which is only
well defined when no other request changes the engine's cache in between.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> Response:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return Response(int(resp.status), {k.lower(): v for k, v in resp.headers.items()}, resp.read())
    except urllib.error.HTTPError as exc:
        return Response(int(exc.code), {k.lower(): v for k, v in exc.headers.items()}, exc.read())


def post(url: str, body: Any, headers: dict[str, str] | None = None, timeout_s: float = 120.0) -> Response:
    return request("POST", url, body, headers, timeout_s)


def get(url: str, headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> Response:
    return request("GET", url, None, headers, timeout_s)


def cached_tokens(usage: dict[str, Any] | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (needs ``--enable-prompt-tokens-details``)."""
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if value is not None else None


def metric_sum(metrics_text: str, name: str) -> float:
    """Sum of every sample of a Prometheus metric (all label sets), e.g.
    ``vllm:prefix_cache_hits_total``."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric = head.split("{", 1)[0]
        if metric == name:
            total += float(value)
    return total
