"""Fixtures of the integration tests; the helpers live in ``gateway_harness``."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate_tools.redis_server import RedisServer
from tests.integration.gateway_harness import procs

__all__ = ["procs", "redis_server"]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A throwaway redis-server, stopped after the test."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
