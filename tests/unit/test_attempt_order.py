"""``Proxy._attempt``'s order (docs/architecture.md, "Request path", step 6): the decided
attempt's load is published (``Fleet.flights_changed`` with its ``Dispatch``: a worker of several
ends its decision's turn there), the request is written to the replica (``Upstream.start``, no
await) before the decision is committed, nothing else runs on the event loop between the
publication and the end of the commit, and an attempt that fails before ``send`` republishes the
load without it and closes the connection it wrote on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.proxy import Proxy
from gateway.routing import Speculation
from gateway.upstream import Retry
from router_policies.flights import Dispatch

FEATURES = SimpleNamespace(prompt_tokens=100, block_size=16, block_keys=())


class _Out:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def abandon(self) -> None:
        self.log.append("abandon")


class _Upstream:
    outcomes = None

    def __init__(self, log: list[str], fail: BaseException | None = None) -> None:
        self.log, self.fail = log, fail

    def start(self, ctx: Any, rec: Any) -> _Out:
        assert ctx.state is None
        self.log.append(f"write {rec.id}")
        self.out = _Out(self.log)
        return self.out

    async def send(self, a: Any, out: _Out) -> str:
        assert out is self.out and a.may_retry
        self.log.append("send")
        await asyncio.sleep(0)
        if self.fail is not None:
            raise self.fail
        return "answer"


class _Router:
    def __init__(self, log: list[str], fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def commit(self, state: Any, features: Any, choice: Any) -> Speculation:
        assert state is None and features is FEATURES
        self.log.append(f"commit {choice.record.id}")
        if self.fail:
            raise RuntimeError("a bug in the commit")
        self.spec = Speculation(choice.record.id, 0)
        return self.spec

    def undo(self, spec: Speculation) -> None:
        assert spec is self.spec
        self.log.append("undo")


class _Fleet:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def flights_changed(self, record: Any, adding: Dispatch | None = None) -> None:
        if adding is not None:
            assert (adding.prompt_tokens, adding.cached_tokens, adding.output_tokens) == (100, 32, 8)
        self.log.append(f"load {record.id}" + (" decided" if adding is not None else ""))


def _proxy(upstream: _Upstream, router: _Router) -> Proxy:
    p = object.__new__(Proxy)  # only _attempt's three collaborators
    p._upstream = upstream  # type: ignore[assignment]
    p._router = router  # type: ignore[assignment]
    p._fleet = _Fleet(upstream.log)  # type: ignore[assignment]
    return p


async def _attempt(p: Proxy, log: list[str]) -> Any:
    async def other_request() -> None:  # any other task: it may run only at an await
        log.append("other")

    task = asyncio.get_running_loop().create_task(other_request())
    choice = SimpleNamespace(record=SimpleNamespace(id="r0"), state=None, predicted_tokens=32)
    info = SimpleNamespace(deferred=None)
    ctx = SimpleNamespace(state=None, parsed=SimpleNamespace(max_output_tokens=8))
    try:
        return await p._attempt(ctx, FEATURES, info, choice, True)  # type: ignore[arg-type]
    finally:
        await task


async def test_the_request_is_written_before_the_commit_and_nothing_runs_between() -> None:
    log: list[str] = []
    assert await _attempt(_proxy(_Upstream(log), _Router(log)), log) == "answer"
    assert log == ["load r0 decided", "write r0", "commit r0", "send", "other", "abandon"]


async def test_a_retry_undoes_the_commit() -> None:
    log: list[str] = []
    with pytest.raises(Retry):
        await _attempt(_proxy(_Upstream(log, Retry("503", "r0: 503")), _Router(log)), log)
    assert log == ["load r0 decided", "write r0", "commit r0", "send", "other", "undo", "abandon"]


async def test_a_failed_commit_republishes_the_load_and_abandons_the_written_request() -> None:
    log: list[str] = []
    with pytest.raises(RuntimeError):
        await _attempt(_proxy(_Upstream(log), _Router(log, fail=True)), log)
    assert log == ["load r0 decided", "write r0", "commit r0", "load r0", "abandon", "other"]
