"""The TTFT model's flight starts when the request is written to the replica (``Upstream.start``),
not when ``send`` runs after the commit that follows the write (gateway/upstream.py, ``Sending``):
the first-byte time it observes and fits is the replica's, whatever the gateway does between the
write and ``send`` (the commit, or the core the woken replica takes from it)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from gateway.config import parse_config
from gateway.fleet import Fleet, ReplicaRecord
from gateway.metrics import GatewayMetrics
from gateway.request import request_of
from gateway.request_context import Attempt, RequestContext
from gateway.routing import Router, RoutingState
from gateway.upstream import Upstream
from gateway.upstream_client import UpstreamClient
from router_policies.flights import Dispatch
from router_policies.policy import RequestFeatures
from router_policies.prefix_index import PrefixIndex
from router_policies.registry import build_policy

ANSWER = json.dumps({"choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": 1}}).encode()
COMMIT_S = 5.0  # the TTFT clock's advance between the write and ``send``


class _Replica(asyncio.Protocol):
    """Answers each request head at once (its body is small enough to come with it)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            self.transport.write(head % len(ANSWER) + ANSWER)


class _HearingFleet(Fleet):
    """A fleet recording r0's requests and pending prefill each time ``Upstream`` says a flight
    changed (what a worker's fleet publishes to the other workers, gateway/local_hub_client.py)."""

    heard: list[tuple[int, int]]

    def flights_changed(self, record: ReplicaRecord, adding: Dispatch | None = None) -> None:
        assert adding is None  # Upstream publishes flights; the decision's load is the proxy's
        self.heard.append((record.flights.requests, record.flights.pending_prefill_tokens))


async def _first_byte_ms(pooled: bool, heard: list[tuple[int, int]] | None = None) -> float:
    """The access log's observed first byte of one attempt whose ``send`` runs ``COMMIT_S`` of
    the TTFT clock after its write; ``pooled``: the request is written on an idle pooled
    connection (else ``send`` connects first)."""
    server = await asyncio.get_running_loop().create_server(_Replica, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = parse_config(
        {
            "models": [{"name": "m", "block_size": 16}],
            "replicas": [{"id": "r0", "url": f"http://127.0.0.1:{port}"}],
            "policy": {"name": "round_robin"},
        }
    )
    now = [100.0]
    index = PrefixIndex()
    fleet = _HearingFleet(config, index, clock=lambda: now[0])
    fleet.heard = heard if heard is not None else []
    fleet.check_result("r0", True)
    client = UpstreamClient()
    upstream = Upstream(client, fleet, GatewayMetrics(CollectorRegistry(), index, fleet, dict))
    router = Router(index, fleet)
    state = RoutingState(config, build_policy("round_robin", {}, seed=0), None)  # type: ignore[arg-type]
    body = {"model": "m", "prompt": "hello", "max_tokens": 1}
    try:
        if pooled:  # a first request leaves its connection idle in the pool
            warm = client.start(f"http://127.0.0.1:{port}/v1/completions", b"{}", CIMultiDict())
            answer = await client.finish(warm, 1.0)
            assert await answer.read() == ANSWER
            answer.release()  # read to its end: the connection is pooled
        raw = json.dumps(body).encode()
        ctx = RequestContext(make_mocked_request("POST", "/v1/completions"), state, None)
        ctx.parsed = request_of("completions", body, raw=raw)
        features = RequestFeatures("m", [], 64, 16)
        choice = router.decide(state, features, router.match(features))
        sending = upstream.start(ctx, choice.record)
        # written at once on the pooled connection; else not until send connects
        assert (sending.out.sent is not None) is pooled
        now[0] += COMMIT_S
        info = SimpleNamespace(approximate=False, deferred_chars=0, deferred=None)
        dispatch = Dispatch.of(choice.state, features, choice.predicted_tokens, 1)
        a = Attempt(ctx, features, info, choice, dispatch, router.commit(state, features, choice), True)  # type: ignore[arg-type]
        resp = await upstream.send(a, sending)
        assert resp.status == 200 and client.opened == 1
        return float(ctx.log["first_byte_ms"])
    finally:
        client.close()
        server.close()


async def test_the_flight_starts_when_the_request_is_written() -> None:
    # the clock moved by COMMIT_S between the write and send, and not after: the first byte came
    # COMMIT_S after the flight's start (0 ms had the flight started in send)
    assert await _first_byte_ms(pooled=True) == COMMIT_S * 1000


async def test_the_flight_starts_before_a_new_connection_is_made() -> None:
    # no idle connection: send connects and writes, still within the flight
    assert await _first_byte_ms(pooled=False) == COMMIT_S * 1000


async def test_the_fleet_hears_a_flights_first_byte_and_its_end() -> None:
    heard: list[tuple[int, int]] = []
    await _first_byte_ms(pooled=True, heard=heard)
    assert heard == [(1, 0), (0, 0)]  # the prefill done at the first byte; the flight gone at its end
