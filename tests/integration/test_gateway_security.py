"""``kvgate serve`` as a real process with the security options on (docs/gateway.md, "Security"):
TLS on the HTTP listener (a self-signed certificate made here with openssl), API keys with
per-key rate limits, per-replica agent credentials and registration rules over real gRPC."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from kvgate_tools.stream_agent import hello
from proto.kvgate.v1 import inventory_pb2 as pb
from tests.integration.gateway_harness import AGENT_TOKEN, REPO, Procs, base_config, procs

__all__ = ["procs"]  # the fixture

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()


def self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def https(
    url: str, cafile: Path, body: bytes | None = None, key: str | None = None
) -> tuple[int, dict[str, str], Any]:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body, method="POST" if body else "GET", headers=headers)
    ctx = ssl.create_default_context(cafile=str(cafile))
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            status, hdrs, raw = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        status, hdrs, raw = exc.code, exc.headers, exc.read()
    text = raw.decode()
    return status, {k.lower(): v for k, v in hdrs.items()}, json.loads(text) if text.startswith("{") else text


def test_tls_api_keys_and_rate_limits(procs: Procs, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# one key a line\nsk-file-key\n")
    b = procs.backend("b0")
    cfg = base_config(
        b,
        auth={
            "http_tls": {"cert": str(cert), "key": str(key)},
            # 0.2/s: the third request within 5 s is refused, however slow the host
            "api_keys": {
                "env": "KVGATE_TEST_KEYS",
                "file": str(keys_file),
                "requests_per_s": 0.2,
                "burst": 2,
            },
        },
    )
    gw = procs.gateway(cfg, env={"KVGATE_TEST_KEYS": "sk-a, sk-b"})
    base = f"https://localhost:{gw.port}"

    # plaintext to the TLS listener gets no HTTP answer
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{gw.port}/health", timeout=5).read()
    assert https(base + "/health", cert)[0] == 200  # probes need no key

    status, headers, doc = https(base + "/v1/chat/completions", cert, CHAT)
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert doc["error"]["code"] == "invalid_api_key" and doc["error"]["type"] == "invalid_request_error"
    status, _, doc = https(base + "/v1/models", cert, key="sk-wrong")
    assert status == 401 and doc["error"]["message"] == "Incorrect API key provided."

    for _ in range(2):  # the burst
        status, _, doc = https(base + "/v1/chat/completions", cert, CHAT, key="sk-a")
        assert status == 200, doc
    status, headers, doc = https(base + "/v1/chat/completions", cert, CHAT, key="sk-a")
    assert status == 429 and int(headers["retry-after"]) >= 1
    assert doc["error"]["code"] == "rate_limit_exceeded" and doc["error"]["type"] == "rate_limit_error"
    # another key has its own bucket; a key from the file works
    assert https(base + "/v1/chat/completions", cert, CHAT, key="sk-b")[0] == 200
    assert https(base + "/v1/models", cert, key="sk-file-key")[0] == 200
    assert b.stats()["requests"] == 3  # only the requests let through reached the replica

    metrics = https(base + "/metrics", cert)[2]
    assert 'kvgate_api_requests_refused_total{reason="missing_key"} 1.0' in metrics
    assert 'kvgate_api_requests_refused_total{reason="invalid_key"} 1.0' in metrics
    assert 'kvgate_api_requests_refused_total{reason="rate_limited"} 1.0' in metrics
    assert "kvgate_api_keys 3.0" in metrics


async def _hello_status(port: int, token: str, msg: pb.AgentMessage) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        sync = channel.stream_stream(
            "/kvgate.v1.Inventory/Sync",
            request_serializer=pb.AgentMessage.SerializeToString,
            response_deserializer=pb.GatewayMessage.FromString,
        )
        call = sync(metadata=(("authorization", f"Bearer {token}"),))
        await call.write(msg)
        try:
            if await call.read() is not grpc.aio.EOF:  # the Hello's Ack
                await call.done_writing()
                while await call.read() is not grpc.aio.EOF:
                    pass
        except grpc.aio.AioRpcError:
            pass  # the status is what the test checks
        return await call.code()


def test_agent_identity_on_the_serving_gateway(procs: Procs) -> None:
    """The gateway process reads per-replica tokens from its environment: b1's token cannot say
    Hello as b0, the shared token cannot register a replica outside auth.registration, and
    neither changes the fleet /admin/replicas shows."""
    b0, b1 = procs.backend("b0"), procs.backend("b1")
    cfg = base_config(
        b0,
        b1,
        auth={
            "agent_tokens": {"b0": "KVGATE_TEST_B0", "b1": "KVGATE_TEST_B1"},
            "registration": {"allowed_cidrs": ["10.0.0.0/8"]},
        },
    )
    gw = procs.gateway(cfg, env={"KVGATE_TEST_B0": "tok-b0", "KVGATE_TEST_B1": "tok-b1"})
    before = {rid: r["url"] for rid, r in gw.replicas().items()}
    assert before == {"b0": b0.url, "b1": b1.url}

    def status(token: str, msg: pb.AgentMessage) -> grpc.StatusCode:
        return asyncio.run(_hello_status(gw.inventory_port, token, msg))

    m = pb.AgentMessage(
        seq=1, hello=pb.Hello(replica_id="b0", block_size=16, models=["m"], protocol_version=1)
    )
    assert status("tok-b1", m) == grpc.StatusCode.PERMISSION_DENIED
    assert status(AGENT_TOKEN, m) == grpc.StatusCode.PERMISSION_DENIED  # b0 has its own token
    assert status("tok-b0", hello("b0", "http://evil.example:1")) == grpc.StatusCode.OK
    assert status(AGENT_TOKEN, hello("x", "http://evil.example:1")) == grpc.StatusCode.PERMISSION_DENIED
    assert status(AGENT_TOKEN, hello("x", "http://10.1.2.3:8000")) == grpc.StatusCode.OK
    after = {rid: r["url"] for rid, r in gw.replicas().items()}
    assert after == {**before, "x": "http://10.1.2.3:8000"}


@pytest.mark.parametrize(
    ("auth", "error"),
    [
        (
            {"agent_tokens": {"r0": "KVGATE_TEST_UNSET"}},
            "auth.agent_tokens.r0: environment variable KVGATE_TEST_UNSET is not set",
        ),
        (
            {"http_tls": {"cert": "/nonexistent/c.pem", "key": "/nonexistent/k.pem"}},
            "auth.http_tls: cannot load cert",
        ),
        ({"api_keys": {"env": "KVGATE_TEST_UNSET"}}, "auth.api_keys: no key found"),
    ],
)
def test_start_refused_without_its_secrets(procs: Procs, auth: dict[str, Any], error: str) -> None:
    """A security option whose secret or file is missing stops start-up (exit 2, one line): the
    gateway never runs open when it was configured closed."""
    path = procs.write_config({"models": [{"name": "m"}], "auth": auth})
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--listen", "127.0.0.1:0",
           "--inventory", "127.0.0.1:0"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2 and f"kvgate serve: error: {error}" in done.stderr
