"""Waiting for a state in tests: poll a check until it holds. The timeout bounds a hang only; a
test never asserts on how fast a state arrives through these."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def wait_until(
    check: Callable[..., Any], timeout_s: float = 15.0, what: str = "condition", interval_s: float = 0.05
) -> Any:
    """Poll ``check()`` until it returns a truthy value, and return that value."""
    end = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"{what} not reached after {timeout_s}s")
        time.sleep(interval_s)


async def until(
    check: Callable[[], object], what: str = "condition", timeout_s: float = 20.0, interval_s: float = 0.02
) -> None:
    """Poll ``check()`` (a function, or a coroutine function) until it is truthy, without blocking
    the event loop."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        if loop.time() > end:
            raise TimeoutError(f"{what} not reached after {timeout_s}s")
        await asyncio.sleep(interval_s)
