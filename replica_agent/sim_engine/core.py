"""The engine core: one asyncio task owns the replica model and drives it in real time.

Single writer: only ``EngineCore.run`` mutates the model, the block registry and the publisher's
sequence. HTTP handlers talk to it through a bounded command queue (submit, abort, reset, debug
snapshot) and read per-request progress from ``RequestHandle`` objects the core updates.

Real time: model time is the event loop's monotonic clock. The core runs ``step(start)``, sleeps
until the step's ``end`` (when its tokens and KV events exist), then delivers them: one KV-event
batch per step that has events (as vLLM publishes), first tokens, decode tokens, finished
requests. Commands that arrive while a step runs are applied at the next step boundary, which is
also when a submitted request may join (as in vLLM, a request joins the next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from replica_agent.sim_engine.block_registry import BlockRegistry, PromptBlocks
from replica_agent.sim_engine.kv_events import KvEventPublisher
from replica_agent.sim_engine.protocol import ApiError
from router_policies.sim import replica_model as rm

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class RequestHandle:
    rid: int
    prompt_len: int
    max_tokens: int
    blocks: PromptBlocks
    arrival: float
    produced: int = 0  # tokens out so far
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    first_token_at: float | None = None
    finished: bool = False
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True, slots=True)
class _Submit:
    handle: RequestHandle


@dataclass(frozen=True, slots=True)
class _Abort:
    handle: RequestHandle


@dataclass(frozen=True, slots=True)
class _Call:
    """Run ``fn`` inside the core task at a step boundary and resolve ``future`` with its result."""

    fn: Callable[[], Any]
    future: asyncio.Future[Any]


_Command = _Submit | _Abort | _Call


@dataclass(frozen=True, slots=True)
class CoreHooks:
    """What the core reports as it runs, from its own task (the server wires them to its metrics)."""

    on_first_token: Callable[[float], None]  # seconds from the request's arrival
    on_finished: Callable[[RequestHandle], None]
    on_preempted: Callable[[int], None]  # requests one step preempted


class EngineCore:
    def __init__(
        self,
        model: rm.ReplicaModel,
        registry: BlockRegistry,
        publisher: KvEventPublisher,
        max_pending: int,
        hooks: CoreHooks,
    ) -> None:
        if max_pending <= 0:
            raise ValueError("max_pending must be positive")
        self._model = model
        self._registry = registry
        self._publisher = publisher
        self._max_pending = max_pending
        self._hooks = hooks
        self._block_size = model.config.block_size
        self._num_blocks = model.config.num_blocks
        # In the engine: submitted and neither finished nor aborted. Bounded by max_pending.
        self._handles: dict[int, RequestHandle] = {}
        # Submissions are bounded by max_pending, aborts by the handles (at most max_pending); every
        # command but an abort is refused with 503 once it would leave aborts less than that room.
        self._commands: asyncio.Queue[_Command] = asyncio.Queue(maxsize=2 * max_pending + 64)
        self._ids = itertools.count()
        self._accepted = 0  # submits queued but not yet applied, counted against max_pending
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._loop = asyncio.get_running_loop()

    # ------------------------------------------------------------------ handler side
    @property
    def pending(self) -> int:
        return len(self._handles) + self._accepted

    @property
    def registry_entries(self) -> int:
        return len(self._registry)

    def now(self) -> float:
        return self._loop.time()

    def submit(self, tokens: list[int], max_tokens: int) -> RequestHandle:
        need = -(-(len(tokens) + max_tokens) // self._block_size)
        if need > self._num_blocks:
            raise ApiError(
                400,
                f"request needs {need} KV blocks ({len(tokens)} prompt + {max_tokens} output tokens), "
                f"the engine's KV cache has {self._num_blocks}",
                "max_tokens",
            )
        if self._closing:
            raise ApiError(503, "engine shutting down")
        if self.pending >= self._max_pending:
            raise ApiError(503, f"engine queue full ({self._max_pending} requests pending)")
        blocks = self._registry.describe(tokens)
        handle = RequestHandle(next(self._ids), len(tokens), max_tokens, blocks, self.now())
        self._put(_Submit(handle))
        self._accepted += 1
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Client gone: free the request's slot and blocks at the next step boundary."""
        if not handle.finished and handle.error is None:
            self._commands.put_nowait(_Abort(handle))  # room kept for every handle's abort (_put)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the core task at a step boundary (consistent with published events)."""
        if self._closing:
            raise ApiError(503, "engine shutting down")
        future: asyncio.Future[Any] = self._loop.create_future()
        self._put(_Call(fn, future))
        return await future

    def _put(self, cmd: _Command) -> None:
        """Queue a command that is not an abort, keeping ``max_pending`` places for aborts."""
        if self._commands.qsize() >= self._commands.maxsize - self._max_pending:
            raise ApiError(503, "engine command queue full")
        self._commands.put_nowait(cmd)

    # ------------------------------------------------------------------ owner task
    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="sim-engine-core")

    async def stop(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            # A core that already failed re-raises its error here; it was logged by run().
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        while not self._commands.empty():
            cmd = self._commands.get_nowait()
            if isinstance(cmd, _Submit):
                self._fail(cmd.handle, "engine shutting down")
            elif isinstance(cmd, _Call) and not cmd.future.done():
                cmd.future.cancel()
        for handle in list(self._handles.values()):
            self._fail(handle, "engine shutting down")
        self._handles.clear()

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done() and not self._closing

    async def run(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug in the step loop must not leave clients waiting forever: fail them all and
            # refuse new work (/health turns 503).
            log.exception("engine core failed")
            self._closing = True
            for handle in list(self._handles.values()):
                self._fail(handle, "engine core failed")
            self._handles.clear()
            raise

    async def _run(self) -> None:
        model = self._model
        while True:
            self._apply_pending_commands()
            t = model.next_step_time()
            if t is None:
                self._apply(await self._commands.get())
                continue
            res = model.step(max(t, self.now()))
            # Outputs exist at res.end. sleep(0) still yields when the step is instantaneous.
            await asyncio.sleep(max(0.0, res.end - self.now()))
            self._deliver(res)

    def _apply_pending_commands(self) -> None:
        while not self._commands.empty():
            self._apply(self._commands.get_nowait())

    def _apply(self, cmd: _Command) -> None:
        if isinstance(cmd, _Submit):
            self._accepted -= 1
            h = cmd.handle
            req = rm.EngineRequest(h.rid, h.blocks.keys, h.prompt_len, h.max_tokens)
            try:
                self._model.submit(req, self.now())
            except ValueError as exc:  # RequestTooLargeError included; checked earlier, kept as a guard
                self._fail(h, str(exc))
                return
            self._registry.acquire(h.blocks)
            self._handles[h.rid] = h
        elif isinstance(cmd, _Abort):
            h = cmd.handle
            if self._handles.pop(h.rid, None) is not None:
                self._model.abort(h.rid)
                self._registry.release(h.blocks.keys)
                self._fail(h, "aborted")
        elif not cmd.future.done():
            try:
                cmd.future.set_result(cmd.fn())
            except Exception as exc:  # the caller sees the error; the core goes on
                cmd.future.set_exception(exc)

    def _deliver(self, res: rm.StepResult) -> None:
        if res.events:
            self._publisher.publish(self._registry.translate(res.events))
        if res.preempted:
            self._hooks.on_preempted(len(res.preempted))
        now = self.now()
        touched: list[RequestHandle] = []
        handles = self._handles
        for ft in res.first_tokens:
            h = handles.get(ft.request_id)  # type: ignore[call-overload]
            if h is None:
                continue
            h.cached_tokens = ft.cached_tokens
            h.produced += 1
            h.first_token_at = now
            self._hooks.on_first_token(now - h.arrival)
            touched.append(h)
        for rid, n in res.decoded:
            h = handles.get(rid)  # type: ignore[call-overload]
            if h is not None:
                h.produced += n
                touched.append(h)
        for rid in res.finished:
            h = handles.pop(rid, None)  # type: ignore[call-overload]
            if h is not None:
                h.finished = True
                self._registry.release(h.blocks.keys)
                self._hooks.on_finished(h)
                touched.append(h)
        for h in touched:
            h.changed.set()

    @staticmethod
    def _fail(handle: RequestHandle, message: str) -> None:
        handle.error = message
        handle.changed.set()
