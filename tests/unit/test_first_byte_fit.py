"""The TTFT model's fit of a streamed answer's first byte (gateway/upstream.py, ``Upstream._fit``)
runs once, after those bytes went out to the client, or when the relay ends without them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry

from gateway.config import parse_config
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.prediction_audit import AttemptAudit
from gateway.upstream import Upstream
from gateway.upstream_client import UpstreamClient
from router_policies.placement import IndexAtDispatch
from router_policies.prefix_index import PrefixIndex


class _Writer:
    """aiohttp's payload writer, recording what the relay writes."""

    def __init__(self, log: list[str], fail: bool = False) -> None:
        self.log, self.fail = log, fail
        self.buffer_size = self.output_size = 0

    async def write_headers(self, status_line: str, headers: Any) -> None:
        assert status_line.startswith("HTTP/1.1 200") and headers is not None
        self.log.append("headers")

    async def write(self, chunk: bytes) -> None:
        if self.fail:
            raise ConnectionResetError("the client went away")
        self.log.append(f"write {chunk.decode()}")

    async def write_eof(self, chunk: bytes = b"") -> None:
        self.log.append(f"eof{chunk.decode()}")

    async def drain(self) -> None:
        pass

    def send_headers(self) -> None:
        pass

    def enable_compression(self, *args: Any) -> None:
        pass

    def enable_chunking(self) -> None:
        pass


class _Body:
    """The upstream response's body: the rest after the first bytes."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        return self.chunks.pop(0) if self.chunks else b""

    def set_exception(self, exc: BaseException) -> None:
        raise AssertionError(exc)


async def _relay(fail: bool) -> tuple[list[str], bool]:
    """Relay a two-chunk SSE answer to a client whose writes fail or not; what happened, in order."""
    index = PrefixIndex()
    config = parse_config({"models": [{"name": "m", "block_size": 16}]})
    fleet = Fleet(config, index)
    upstream = Upstream(UpstreamClient(), fleet, GatewayMetrics(CollectorRegistry(), index, fleet, dict))
    log: list[str] = []
    request = make_mocked_request("POST", "/v1/completions", writer=_Writer(log, fail))
    ctx = SimpleNamespace(state=SimpleNamespace(config=config), request=request, log={}, elapsed=lambda: 0.0)
    rec = SimpleNamespace(id="r0", health=SimpleNamespace(proxy_success=lambda: log.append("success")))
    up = SimpleNamespace(status=200, content=_Body([b"data: b\n\n"]))
    info = SimpleNamespace(approximate=False, deferred_chars=0, deferred=None)
    audit = AttemptAudit(info, IndexAtDispatch(0, 0))  # type: ignore[arg-type]
    _, complete = await upstream._stream(
        SimpleNamespace(ctx=ctx, record=rec),  # type: ignore[arg-type]
        audit,
        up,  # type: ignore[arg-type]
        (b"data: a\n\n", False, lambda: log.append("fit")),
        request.headers.copy(),
    )
    return log, complete


async def test_the_fit_runs_after_the_first_bytes_are_written() -> None:
    log, complete = await _relay(fail=False)
    assert complete
    assert log == ["headers", "write data: a\n\n", "fit", "write data: b\n\n", "success", "eof"]


async def test_the_fit_runs_once_when_the_client_is_gone() -> None:
    log, complete = await _relay(fail=True)
    assert not complete and log.count("fit") == 1  # the arrival is still an observation
