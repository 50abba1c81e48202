"""Stopping a background task: the one way the gateway's owners of tasks (health checker, shared
state supervisor, ...) and the tests end one (docs/architecture.md, "State and its one writer").
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and return once it has finished, its ``CancelledError`` swallowed (an error
    it raised instead propagates). ``None``: nothing to stop."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
