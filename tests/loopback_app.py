"""An aiohttp application served on loopback for the length of a test (a stand-in engine or
replica answering a few routes)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    """Serve ``app`` on 127.0.0.1 at a free port; yields the port, and cleans up on exit."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
