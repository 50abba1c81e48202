"""Observability on a real gateway process: agents' inventory through /admin, the prediction
audit, metrics, access logs, and OTLP spans received by a collector in the test."""

from __future__ import annotations

import asyncio
import json
import signal
from concurrent import futures
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

from gateway.app_parts import build_state
from gateway.config import parse_config
from gateway.request import Endpoint
from kvgate_tools.stream_agent import StreamAgent
from proto.kvgate.v1 import inventory_pb2 as pb
from tests.integration.gateway_harness import AGENT_TOKEN, Gateway, Procs, base_config, http
from tests.polling import wait_until

JSON = {"content-type": "application/json"}


def _post(gw: Gateway, doc: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    return http("POST", gw.url + "/v1/completions", json.dumps(doc).encode(), JSON)


def _keys_for(cfg: dict[str, Any], body: dict[str, Any]) -> tuple[list[int], int]:
    """The block keys the gateway computes for ``body`` (same featurizer as the app)."""
    state = build_state(parse_config(cfg))
    kind: Endpoint = "chat" if "messages" in body else "completions"

    feats, _info = asyncio.run(state.featurizer.features(kind, body))
    return list(feats.block_keys), feats.block_size


def test_agent_inventory_drives_routing_and_admin_views(procs: Procs) -> None:
    r0, r1 = procs.backend("r0"), procs.backend("r1")
    cfg = base_config(r0, policy={"name": "kv_aware"})
    gw = procs.gateway(cfg)
    # 5 blocks, 3 of them held by r1: a match deep enough to outweigh kv_aware's cache-fill term
    body = {"model": "m", "prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 4}
    keys, block_size = _keys_for(cfg, body)
    engine_block = cfg["models"][0].get("block_size", 16)
    assert len(keys) >= 3
    agent = StreamAgent(gw.inventory_port, AGENT_TOKEN)
    try:
        agent.send(hello=pb.Hello(replica_id="r1", url=r1.url, models=["m"], block_size=engine_block,
                                  engine="fake", protocol_version=1))  # fmt: skip
        agent.send(snapshot=pb.SnapshotChunk(snapshot_id=1, keys=keys[:3], medium="GPU", last=True))
        agent.send(load=pb.Load(running=0, waiting=0, kv_usage=0.25))
        wait_until(lambda: gw.replicas().get("r1", {}).get("kv_usage") == 0.25, what="agent registered")
        reps = gw.replicas()
        assert reps["r1"]["agent_connected"] is True and reps["r1"]["source"] == "agent"
        assert reps["r1"]["kv_usage"] == 0.25 and reps["r0"]["source"] == "static"

        status, doc = gw.admin("GET", "/admin/index?replica=r1")
        assert status == 200 and doc == {"replica": "r1", "keys": sorted(keys[:3])}
        status, doc = gw.admin("GET", "/admin/index")
        assert doc["replicas"]["r1"] == {"precise": 3, "approximate": 0}
        assert gw.admin("GET", "/admin/index?replica=nope")[0] == 404

        status, doc = gw.admin("POST", "/admin/explain", json.dumps(body).encode())
        assert status == 200
        by_id = {r["id"]: r for r in doc["replicas"]}
        assert by_id["r1"]["matched_blocks"] == 3 and by_id["r0"]["matched_blocks"] == 0
        assert by_id["r1"]["matched_tokens"] == 3 * block_size
        assert doc["decision"]["replica"] == "r1" and doc["decision"]["reason"] == "kv_aware:cache"
        assert set(by_id["r0"]) >= {"score", "healthy", "in_flight_requests"}
        # the policy's terms per replica: the token rule's cost (the score) and time_r
        assert by_id["r0"]["terms"] == {"cost": by_id["r0"]["score"], "time": 1.0}
        # explain forwarded nothing
        assert r0.stats()["requests"] == 0 and r1.stats()["requests"] == 0

        status, headers, _ = _post(gw, {**body, "fake_cached_tokens": 3 * block_size})
        assert status == 200
        assert headers["x-kvgate-replica"] == "r1"
        assert headers["x-kvgate-matched-tokens"] == str(3 * block_size)
        metrics = gw.metrics()
        assert 'kvgate_prediction_audit_total{outcome="exact",replica="r1"} 1.0' in metrics
        assert "kvgate_inventory_snapshots_applied_total 1.0" in metrics
    finally:
        agent.close()
    wait_until(lambda: gw.replicas()["r1"]["agent_connected"] is False, what="agent gone")


def test_prediction_audit_streaming_and_not(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    # cold: the gateway predicts 0 cached tokens
    assert _post(gw, {"model": "m", "prompt": "a", "fake_cached_tokens": 0})[0] == 200
    assert _post(gw, {"model": "m", "prompt": "b", "fake_cached_tokens": 32})[0] == 200
    stream = {"model": "m", "prompt": "c", "stream": True, "stream_options": {"include_usage": True}}
    assert _post(gw, {**stream, "fake_cached_tokens": 0})[0] == 200
    # without include_usage the stream carries no usage: nothing to audit
    assert _post(gw, {"model": "m", "prompt": "d", "stream": True, "fake_cached_tokens": 16})[0] == 200
    m = gw.metrics()
    assert 'kvgate_prediction_audit_total{outcome="exact",replica="r0"} 2.0' in m
    assert 'kvgate_prediction_audit_total{outcome="under",replica="r0"} 1.0' in m
    assert 'kvgate_prediction_exact_fraction{replica="r0"} 0.6666666666666666' in m
    assert 'kvgate_prediction_error_tokens_count{replica="r0"} 3.0' in m
    audit = gw.replicas()["r0"]["prediction_audit"]
    assert (audit["total"], audit["exact"]) == (3, 2)


def test_metrics_cover_requests_decisions_latency_and_index(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    assert _post(gw, {"model": "m", "prompt": "x" * 300})[0] == 200
    assert _post(gw, {"model": "zz", "prompt": "x"})[0] == 404
    m = gw.metrics()
    for needle in [
        'kvgate_requests_total{policy="round_robin",replica="r0",status="200"} 1.0',
        'kvgate_requests_total{policy="round_robin",replica="none",status="404"} 1.0',
        "kvgate_decision_seconds_count 1.0",
        "kvgate_features_seconds_count 1.0",
        'kvgate_predicted_matched_tokens_count{policy="round_robin"} 1.0',
        'kvgate_ttft_seconds_count{replica="r0"} 1.0',
        'kvgate_e2e_seconds_count{replica="r0"} 1.0',
        'kvgate_index_entries{kind="approximate",replica="r0"}',
        "kvgate_index_table_bytes ",
        "kvgate_index_keys ",
        'kvgate_replica_healthy{replica="r0"} 1.0',
        "kvgate_inventory_events_applied_total",
    ]:
        assert needle in m, needle


def _access_lines(gw: Gateway) -> list[dict[str, Any]]:
    out = []
    for line in gw.stderr().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


@pytest.mark.parametrize("log_prompts", [False, True])
def test_access_log_is_json_and_keeps_prompts_out_unless_asked(procs: Procs, log_prompts: bool) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b, telemetry={"log_prompts": log_prompts}))
    assert _post(gw, {"model": "m", "prompt": "my secret prompt"})[0] == 200
    lines = wait_until(lambda: _access_lines(gw), what="an access log line")
    entry = lines[-1]
    assert entry["status"] == 200 and entry["replica"] == "r0" and entry["model"] == "m"
    assert {"duration_ms", "dispatch_ms", "ttft_ms", "policy", "reason", "prompt_tokens", "ts"} <= set(entry)
    assert 0 <= entry["dispatch_ms"] <= entry["ttft_ms"] <= entry["duration_ms"]
    # the TTFT model's prediction at dispatch beside what it observed: dispatch to first byte on
    # the model's own clock, so within ttft_ms and, but for the microseconds between the
    # statements that read the clocks, ttft_ms - dispatch_ms (2 ms: a collection between them)
    assert entry["predicted_first_byte_ms"] > 0
    assert 0 < entry["first_byte_ms"] <= entry["ttft_ms"] + 0.01
    assert entry["first_byte_ms"] == pytest.approx(entry["ttft_ms"] - entry["dispatch_ms"], abs=2.0)
    assert ("my secret prompt" in gw.stderr()) is log_prompts
    assert "request_id" not in entry  # none sent


def test_access_log_carries_the_clients_request_id_bounded(procs: Procs) -> None:
    b = procs.backend("r0")
    gw = procs.gateway(base_config(b))
    body = json.dumps({"model": "m", "prompt": "hello"}).encode()
    for rid in ("client-42", "x" * 1000):
        assert http("POST", gw.url + "/v1/completions", body, {**JSON, "x-request-id": rid})[0] == 200

    def ids() -> list[str]:
        return [e["request_id"] for e in _access_lines(gw) if "request_id" in e]

    wait_until(lambda: len(ids()) == 2, what="two access log lines")
    assert ids() == ["client-42", "x" * 128]


class _Collector(otlp_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Any] = []

    def Export(self, request: Any, _context: Any) -> Any:
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                self.spans.extend(ss.spans)
        return otlp.ExportTraceServiceResponse()


def test_spans_are_exported_over_otlp(procs: Procs) -> None:
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    otlp_grpc.add_TraceServiceServicer_to_server(collector, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        b = procs.backend("r0")
        gw = procs.gateway(base_config(b, telemetry={"otlp_endpoint": f"127.0.0.1:{port}"}))
        assert _post(gw, {"model": "m", "prompt": "trace me " * 20})[0] == 200
        gw.proc.send_signal(signal.SIGTERM)  # shutdown flushes the last spans
        assert gw.proc.wait(30) == 0
        spans = [s for s in collector.spans if s.name == "kvgate.request"]
        assert len(spans) == 1
        attrs = {a.key: a.value for a in spans[0].attributes}
        assert attrs["kvgate.replica"].string_value == "r0"
        assert attrs["kvgate.reason"].string_value == "round_robin"
        assert attrs["http.status_code"].int_value == 200
        assert attrs["kvgate.prompt_tokens"].int_value > 0
        assert "kvgate.predicted_cached_tokens" in attrs
    finally:
        server.stop(None)


def test_approximate_requests_are_audited_as_such(procs: Procs) -> None:
    """Character-block features (no tokenizer) predict an estimate: audited, and an inexact one
    is put down to them (gateway/prediction_audit.py: approximate_features)."""
    b = procs.backend("r0")
    cfg = base_config(b)
    cfg["models"] = [{"name": "m", "tokenizer": None}]  # character blocks only
    gw = procs.gateway(cfg)
    assert _post(gw, {"model": "m", "prompt": "p" * 500, "fake_cached_tokens": 7})[0] == 200
    assert _post(gw, {"model": "m", "prompt": "q" * 500, "fake_cached_tokens": 0})[0] == 200
    m = gw.metrics()
    assert 'kvgate_features_total{approximate="true",mode="chars"} 2.0' in m
    assert 'kvgate_prediction_audit_inexact_total{cause="approximate_features",replica="r0"} 1.0' in m
    audit = gw.replicas()["r0"]["prediction_audit"]
    assert (audit["total"], audit["exact"], audit["inexact_causes"]) == (2, 1, {"approximate_features": 1})
    entry = wait_until(lambda: _access_lines(gw), what="access log")[0]
    assert entry["approximate"] is True and entry["audit_cause"] == "approximate_features"
