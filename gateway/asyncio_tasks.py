"""Stopping a background task: the one way the gateway's owners of tasks (health checker, shared
state supervisor, ...) and the tests end one (docs/architecture.md, "State and its one writer");
``TaskSet``, an owner's short-lived tasks (late audits, featurizers retiring, the local hub's
worker channels), held while they run and ended together.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and return once it has finished, its ``CancelledError`` swallowed (an error
    it raised instead propagates). ``None``: nothing to stop."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class TaskSet:
    """The tasks one owner started and must end at its ``stop``.

    Invariants: a task is in the set from its start until it is done (the event loop keeps only
    weak references to tasks: one nobody holds can be collected while it waits); ``stop``
    cancels every task still in it and returns once all have finished, leaving it empty."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, coro: Coroutine[Any, Any, None], name: str | None = None) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.adopt(task)
        return task

    def adopt(self, task: asyncio.Task[Any]) -> None:
        """Hold ``task``, started elsewhere (a server's connection handler), until it is done."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Cancel the tasks and wait for them (and for any one of them started meanwhile); the
        first error a task raised instead of being cancelled propagates, once all have ended."""
        errors: list[BaseException] = []
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            ends = await asyncio.gather(*tasks, return_exceptions=True)
            errors += [
                e for e in ends if isinstance(e, BaseException) and not isinstance(e, asyncio.CancelledError)
            ]
            self._tasks.difference_update(tasks)
        if errors:
            raise errors[0]
