"""The stated invariants of the stream relay and the upstream (every flight ended, every response
let go) that no other test enforced, or only in part, each over seeded random operation sequences
(tests/unit/test_invariants_features.py says more)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from gateway.config import parse_config
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import RequestError
from gateway.request import request_of
from gateway.request_context import Attempt, RequestContext
from gateway.routing import Router, RoutingState, Speculation
from gateway.stream_relay import CLIENT_HIGH_WATER, ClientGone, DirectRelay, IdleWatch
from gateway.upstream import Retry, Upstream
from gateway.upstream_client import ConnectError
from router_policies.flights import Dispatch
from router_policies.policy import RequestFeatures
from router_policies.prefix_index import PrefixIndex
from router_policies.registry import build_policy

SEEDS = [0, 1, 2]


# --- gateway/stream_relay.py -------------------------------------------------------------------


class _Reader:
    """The upstream body reader a watch fails: when, and whether the relay was waiting then."""

    def __init__(self) -> None:
        self.watch: IdleWatch | None = None
        self.failed: list[tuple[float, float]] = []  # (since, now) at each failure

    def set_exception(self, exc: BaseException) -> None:
        assert isinstance(exc, TimeoutError) and self.watch is not None
        self.failed.append((self.watch.since, asyncio.get_running_loop().time()))


def _timers(watch: IdleWatch) -> int:
    """The watch's timers scheduled on the loop (due or not), not cancelled."""
    loop: Any = asyncio.get_running_loop()
    handles = [*loop._scheduled, *loop._ready]
    return sum(1 for h in handles if not h.cancelled() and h._callback == watch._fire)


@pytest.mark.parametrize("seed", SEEDS)
async def test_an_idle_watch_keeps_one_timer_and_fails_only_a_reader_waited_on_too_long(seed: int) -> None:
    """stream_relay.py: "at most one timer is scheduled per watch; ``close`` cancels it [...]; a
    watch never fails a reader the relay is not waiting on" (nor one waited on for less than the
    limit)."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    idle_s = 0.01
    for _ in range(2):
        reader = _Reader()
        watch = reader.watch = IdleWatch(reader, idle_s)
        for _ in range(20):
            op = rng.random()
            if op < 0.4:
                watch.since = loop.time()  # the relay starts waiting for the replica
            elif op < 0.7:
                watch.since = math.inf  # a read returned, or the relay writes to a slow client
            await asyncio.sleep(rng.choice([0.0, 0.001, 0.004, 0.012]))
            assert _timers(watch) <= 1
            for since, now in reader.failed:
                assert since != math.inf and now - since >= idle_s - 1e-6
            if reader.failed:
                assert len(reader.failed) == 1 and _timers(watch) == 0
        watch.since = loop.time()  # waiting when it closes: nothing may fail it afterwards
        failures = len(reader.failed)
        watch.close()
        assert _timers(watch) == 0
        await asyncio.sleep(2 * idle_s)
        assert len(reader.failed) == failures


class _Client:
    """The client's transport as ``DirectRelay`` writes to it."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.buffered = 0
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        self.written.append(data)
        self.buffered += len(data)

    def get_write_buffer_size(self) -> int:
        return self.buffered


class _RelayedBody:
    """The upstream body: the relay it feeds, and whether the replica's reading is paused."""

    def __init__(self) -> None:
        self.sink: DirectRelay | None = None
        self.reading = True

    async def readany(self) -> bytes:
        raise AssertionError("a direct relay is fed by the connection's callback")

    def relay(self, sink: DirectRelay) -> None:
        self.sink = sink

    def pause_reading(self) -> None:
        assert self.reading
        self.reading = False

    def resume_reading(self) -> None:
        assert not self.reading
        self.reading = True


class _Drain:
    """aiohttp's writer's ``drain``: returns once the test lets the client drain."""

    def __init__(self) -> None:
        self.drained = asyncio.Event()

    async def write(self, chunk: bytes) -> None:
        raise AssertionError(f"a direct relay writes to the transport, not {chunk!r}")

    async def drain(self) -> None:
        await self.drained.wait()
        self.drained.clear()


@pytest.mark.parametrize("seed", range(6))
async def test_a_direct_relay_ends_once_writes_nothing_after_and_never_ends_paused(seed: int) -> None:
    """stream_relay.py, ``DirectRelay``: "``end`` takes effect once; after it ``piece`` writes
    nothing; while the client's transport holds more than ``CLIENT_HIGH_WATER`` bytes the
    replica's reading is paused [...] and ``run`` resumes it once the client drained; when
    ``run`` returns or raises, the relay has ended and the replica's reading is not paused",
    whether the body ends, fails, the client goes, or the relay task is cancelled."""
    rng = random.Random(seed)
    for _ in range(20):
        client, body, writer = _Client(), _RelayedBody(), _Drain()
        watch = IdleWatch(_Reader(), 60.0)
        relay = DirectRelay(client, body, writer, watch, None)  # type: ignore[arg-type]
        task = asyncio.get_running_loop().create_task(relay.run())
        await asyncio.sleep(0)
        assert body.sink is relay
        first_end: BaseException | None = None
        ended_at: tuple[int, int] | None = None  # (writes, sent) when it ended
        for _ in range(rng.randrange(1, 30)):
            op = rng.random()
            if op < 0.5:
                was_paused = relay.paused
                relay.piece(rng.randbytes(rng.randrange(1, 3 * CLIENT_HIGH_WATER // 4)))
                if relay.paused and not was_paused:  # the bound was crossed by this piece
                    assert client.buffered > CLIENT_HIGH_WATER
            elif op < 0.7:
                client.buffered = 0  # the client read what was written
                writer.drained.set()
            elif op < 0.8:
                exc = rng.choice([None, ConnectionResetError("replica gone"), TimeoutError("idle")])
                if not relay.ended:
                    first_end, ended_at = exc, (len(client.written), relay.sent)
                relay.end(exc)
            elif op < 0.85:
                client.closing = True
            elif op < 0.9:
                task.cancel()
            await asyncio.sleep(0)
            assert body.reading is not relay.paused
            if relay.ended and ended_at is None:  # ended by the relay itself (client gone, cancel)
                first_end, ended_at = relay.exc, (len(client.written), relay.sent)
            if ended_at is not None:
                assert relay.exc is first_end and (len(client.written), relay.sent) == ended_at
            if task.done():
                assert relay.ended and not relay.paused and body.reading
        if not task.done():  # the body ends; a relay waiting for the client gets it drained
            relay.end(None)
            writer.drained.set()
        with contextlib.suppress(asyncio.CancelledError, ConnectionResetError, TimeoutError, ClientGone):
            await task
        assert relay.ended and not relay.paused and body.reading
        watch.close()


# --- gateway/upstream.py -----------------------------------------------------------------------

JSON_ANSWER = b'{"choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": 1}}'
SSE_ANSWER = [b"data: {}\n\n", b"data: {}\n\n", b"data: [DONE]\n\n"]


class _UpResponse:
    """An upstream response as ``Upstream.send`` reads it, scripted by ``how``; counts how it was
    let go (``release`` or ``close``)."""

    def __init__(self, how: str) -> None:
        self.how = how
        sse = how.startswith("sse")
        self.status = 503 if how == "503" else 200
        ctype = "text/event-stream" if sse else "application/json"
        self.headers: CIMultiDict[str] = CIMultiDict({"content-type": ctype})
        self.content_type = ctype
        self.content_length = len(JSON_ANSWER) if how == "json" else None
        self.chunks = list(SSE_ANSWER) if sse else [JSON_ANSWER] * (1 if how == "json" else 4)
        self.released = self.closed = 0

    @property
    def content(self) -> _UpResponse:
        return self

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        if self.how == "hang_first":
            await asyncio.Event().wait()
        if self.how == "fail_first" or (self.how == "sse_fail" and len(self.chunks) < 3):
            raise ConnectionResetError("the replica closed")
        return self.chunks.pop(0) if self.chunks else b""

    async def read(self) -> bytes:
        out = b""
        while chunk := await self.readany():
            out += chunk
        return out

    def set_exception(self, exc: BaseException) -> None:
        pass

    def release(self) -> None:
        self.released += 1

    def close(self) -> None:
        self.closed += 1


class _ScriptedClient:
    """``UpstreamClient`` whose ``finish`` answers, fails or hangs as the attempt's script says."""

    def __init__(self) -> None:
        self.how = "json"
        self.responses: list[_UpResponse] = []
        self.started: list[tuple[str, bytes, CIMultiDict[str]]] = []

    def start(self, url: str, body: bytes, headers: CIMultiDict[str]) -> Any:
        self.started.append((url, body, headers))
        return SimpleNamespace(abandon=lambda: None, at=len(self.started))

    async def finish(self, out: Any, connect_timeout_s: float | None) -> _UpResponse:
        assert out.at == len(self.started) and connect_timeout_s  # the request started last
        await asyncio.sleep(0)
        if self.how == "connect_error":
            raise ConnectError("cannot connect")
        if self.how == "hang_head":
            await asyncio.Event().wait()
        self.responses.append(_UpResponse(self.how))
        return self.responses[-1]


class _ClientWriter:
    """aiohttp's payload writer to the client (no transport: the relay is a ``ChunkRelay``);
    writes nothing anywhere."""

    buffer_size = output_size = 0

    async def _nothing(self, *_args: Any) -> None:
        pass

    def _none(self, *_args: Any) -> None:
        pass

    write_headers = write = write_eof = drain = _nothing
    send_headers = enable_compression = enable_chunking = _none


@pytest.mark.parametrize("seed", SEEDS)
async def test_every_flight_ends_and_every_upstream_response_is_let_go(seed: int) -> None:
    """upstream.py: "every ``Flight`` opened here is ended in a ``finally``; every upstream
    response is released (read to its end) or closed in a ``finally``", whatever becomes of the
    attempt: answered whole or streamed, a 503 retried, a connect error, a failure before the
    first byte or mid-stream, a cancelled request (waiting for the head or the first byte)."""
    rng = random.Random(seed)
    config = parse_config(
        {
            "models": [{"name": "m", "block_size": 16}],
            "replicas": [{"id": "r0", "url": "http://127.0.0.1:1"}],
            "policy": {"name": "round_robin"},
            # "big" answers are larger: passed through as they arrive (Upstream._stream)
            "proxy": {"max_buffered_response_bytes": 2 * len(JSON_ANSWER)},
        }
    )
    index = PrefixIndex()
    fleet = Fleet(config, index)
    fleet.check_result("r0", True)
    client = _ScriptedClient()
    upstream = Upstream(client, fleet, GatewayMetrics(CollectorRegistry(), index, fleet, dict))  # type: ignore[arg-type]
    router = Router(index, fleet)
    state = RoutingState(config, build_policy("round_robin", {}, seed=0), None)  # type: ignore[arg-type]
    features = RequestFeatures("m", [], 64, 16)
    choice = router.decide(state, features, router.match(features))
    dispatch = Dispatch.of(choice.state, features, choice.predicted_tokens, 1)
    rec = choice.record
    info = SimpleNamespace(approximate=False, deferred_chars=0, deferred=None)
    hows = ["json", "big", "503", "connect_error", "fail_first", "sse", "sse_fail", "hang_head", "hang_first"]
    seen: set[str] = set()
    for how in rng.sample(hows * 4, 4 * len(hows)):
        client.how = how
        body = {"model": "m", "prompt": "hello", "max_tokens": 1, "stream": how.startswith("sse")}
        request = make_mocked_request("POST", "/v1/completions", writer=_ClientWriter())
        ctx = RequestContext(request, state, None)
        ctx.parsed = request_of("completions", body, raw=b"{}")
        a = Attempt(ctx, features, info, choice, dispatch, Speculation("r0", 0), rng.random() < 0.8)  # type: ignore[arg-type]
        task = asyncio.get_running_loop().create_task(upstream.send(a, upstream.start(ctx, rec)))
        for _ in range(5):
            await asyncio.sleep(0)
        if how.startswith("hang"):
            assert rec.flights.requests == 1 and not task.done()  # in flight while it waits
            task.cancel()
        with contextlib.suppress(Retry, RequestError, asyncio.CancelledError):
            resp = await task
            assert resp.status in (200, 503)
            seen.add(how)
        assert (rec.flights.requests, rec.flights.tokens, rec.flights.pending_prefill_tokens) == (0, 0, 0)
        assert all(r.released + r.closed == 1 for r in client.responses), how
        if how in ("json", "big", "sse"):
            assert client.responses[-1].released == 1, how  # read to its end: its connection reused
    assert {"json", "big", "sse"} <= seen
    await upstream.stop()
