"""The gateway in front of simulated engines with their agents (real processes, real KV events):
the prediction audit is exact on multi-turn chats, sessions stay where their prefix is cached,
and a client disconnect aborts the engine's request."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvgate_tools.local_fleet import FleetOptions, LocalFleet, http_text
from tests.integration.gateway_harness import http
from tests.polling import wait_until

JSON = {"content-type": "application/json"}

pytestmark = pytest.mark.slow  # whole fleets of engines and agents: `make test` runs them, test-fast not


def _chat(url: str, body: dict[str, Any]) -> tuple[dict[str, str], str, dict[str, Any]]:
    """(headers, assistant text, usage) of one chat request, streamed or not."""
    status, headers, raw = http(
        "POST", url + "/v1/chat/completions", json.dumps(body).encode(), JSON, timeout=60
    )
    assert status == 200, raw
    if not body.get("stream"):
        doc = json.loads(raw)
        return headers, doc["choices"][0]["message"]["content"], doc["usage"]
    text, usage = "", None
    for event in raw.decode().split("\n\n"):
        if not event.startswith("data: {"):
            continue
        chunk = json.loads(event[len("data: ") :])
        if chunk.get("choices"):
            text += chunk["choices"][0]["delta"].get("content") or ""
        if chunk.get("usage"):
            usage = chunk["usage"]
    assert usage is not None
    return headers, text, usage


def _precise(fleet: LocalFleet, replica: str) -> int:
    doc = json.loads(
        urllib.request.urlopen(
            urllib.request.Request(
                fleet.gateway_url + f"/admin/index?replica={replica}", headers=fleet.admin_headers
            ),
            timeout=10,
        ).read()
    )
    return len(doc["keys"])


def test_prediction_audit_is_exact_on_multi_turn_chats(tmp_path: Path) -> None:
    opts = FleetOptions(replicas=2, cache_blocks=4096, policy="kv_aware", log_dir=tmp_path)
    with LocalFleet(opts) as fleet:
        sessions: list[list[dict[str, str]]] = [
            [{"role": "system", "content": f"You are assistant number {s}. " * 20}] for s in range(2)
        ]
        placed: dict[int, set[str]] = {0: set(), 1: set()}
        for turn in range(4):
            for s, msgs in enumerate(sessions):
                msgs.append(
                    {"role": "user", "content": f"Session {s}, question {turn}: explain item {turn}. " * 4}
                )
                body: dict[str, Any] = {"model": opts.model, "messages": msgs, "max_tokens": 6}
                if (turn + s) % 2:
                    body.update(stream=True, stream_options={"include_usage": True})
                headers, text, usage = _chat(fleet.gateway_url, body)
                replica = headers["x-kvgate-replica"]
                placed[s].add(replica)
                # what the gateway predicted is what the engine reports
                assert (
                    int(headers["x-kvgate-matched-tokens"]) == usage["prompt_tokens_details"]["cached_tokens"]
                )
                msgs.append({"role": "assistant", "content": text})
                # before the next turn, let the engine's KV events for this one reach the index
                # (until then the gateway's speculative entry only covers the prompt's blocks)
                held = usage["prompt_tokens"] // opts.block_size
                wait_until(lambda r=replica, n=held: _precise(fleet, r) >= n, what="events applied")
        # each session stayed on one replica (its prefix), and the two sessions spread
        assert all(len(p) == 1 for p in placed.values())
        audits = {r["id"]: r["prediction_audit"] for r in fleet.replicas()}
        assert sum(a["total"] for a in audits.values()) == 8
        assert all(a["exact"] == a["total"] for a in audits.values())
        metrics = http_text(fleet.gateway_url + "/metrics")
        assert 'kvgate_features_total{approximate="false",mode="local"} 8.0' in metrics


def test_client_disconnect_aborts_the_engine_request(tmp_path: Path) -> None:
    opts = FleetOptions(replicas=1, policy="round_robin", agents=False, log_dir=tmp_path, profile="small-cpu")
    with LocalFleet(opts) as fleet:
        body = json.dumps(
            {
                "model": opts.model,
                "prompt": "count " * 50,
                "max_tokens": 8000,
                "stream": True,
                "ignore_eos": True,
            }
        ).encode()
        host, port = "127.0.0.1", fleet.gateway_port
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # streaming has begun

            def metric(name: str) -> float:
                return sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in fleet.engine_metrics(0).splitlines()
                    if line.startswith((name + "{", name + " "))
                )

            def running() -> float:
                return metric("vllm:num_requests_running")

            assert running() == 1.0
        # the socket is closed: the gateway cancels upstream, the engine aborts the request
        wait_until(lambda: running() == 0.0, what="engine request ended")
        # ended by the abort, not by generating its 8,000 tokens
        assert metric("vllm:request_success_total") == 0.0
        assert metric("vllm:generation_tokens_total") < 8000
        wait_until(lambda: fleet.replicas()[0]["in_flight_requests"] == 0, what="gateway slot released")
