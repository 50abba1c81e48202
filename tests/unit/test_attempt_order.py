"""``Proxy._attempt``'s order (docs/architecture.md, "Request path", step 6): the request is
written to the replica (``Upstream.start``, no await) before the decision is committed, nothing
else runs on the event loop between the write and the end of the commit, and an attempt that
fails before ``send`` finishes its POST closes the connection it wrote on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.proxy import Proxy
from gateway.routing import Speculation
from gateway.upstream import Retry


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
        assert state is None and features is None
        self.log.append(f"commit {choice.record.id}")
        if self.fail:
            raise RuntimeError("a bug in the commit")
        self.spec = Speculation(choice.record.id, 0)
        return self.spec

    def undo(self, spec: Speculation) -> None:
        assert spec is self.spec
        self.log.append("undo")


def _proxy(upstream: _Upstream, router: _Router) -> Proxy:
    p = object.__new__(Proxy)  # only _attempt's two collaborators
    p._upstream = upstream  # type: ignore[assignment]
    p._router = router  # type: ignore[assignment]
    return p


async def _attempt(p: Proxy, log: list[str]) -> Any:
    async def other_request() -> None:  # any other task: it may run only at an await
        log.append("other")

    task = asyncio.get_running_loop().create_task(other_request())
    choice = SimpleNamespace(record=SimpleNamespace(id="r0"))
    info = SimpleNamespace(deferred=None)
    try:
        return await p._attempt(SimpleNamespace(state=None), None, info, choice, True)  # type: ignore[arg-type]
    finally:
        await task


async def test_the_request_is_written_before_the_commit_and_nothing_runs_between() -> None:
    log: list[str] = []
    assert await _attempt(_proxy(_Upstream(log), _Router(log)), log) == "answer"
    assert log == ["write r0", "commit r0", "send", "other", "abandon"]


async def test_a_retry_undoes_the_commit() -> None:
    log: list[str] = []
    with pytest.raises(Retry):
        await _attempt(_proxy(_Upstream(log, Retry("503", "r0: 503")), _Router(log)), log)
    assert log == ["write r0", "commit r0", "send", "other", "undo", "abandon"]


async def test_a_failed_commit_abandons_the_written_request() -> None:
    log: list[str] = []
    with pytest.raises(RuntimeError):
        await _attempt(_proxy(_Upstream(log), _Router(log, fail=True)), log)
    assert log == ["write r0", "commit r0", "abandon", "other"]
