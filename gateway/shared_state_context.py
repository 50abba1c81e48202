"""What the shared-state parts have in common (docs/shared-state.md; docs/architecture.md): the
config, the key names, the metrics, this instance's id, the up flag and the stop signal.

The supervisor (``gateway.shared_state.SharedState``) is the one writer of ``up`` and
``stopping``; the publisher, the follower and the load exchange only read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.config import SharedStateConfig
from gateway.shared_state_codec import Keys
from gateway.shared_state_metrics import SharedStateMetrics

Redis = aioredis.Redis

# A replica's keys (stream, snapshot, registration) live this long after the last instance holding
# its agent refreshed them (every load round): a replica gone for good leaves nothing behind.
REPLICA_KEYS_TTL_S = 3600


class Restarted(Exception):
    """Redis answered with a new run_id: it restarted, and (without persistence) lost our keys."""


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(slots=True)
class SharedContext:
    config: SharedStateConfig
    metrics: SharedStateMetrics
    instance_id: str
    clock: Callable[[], float] = time.time
    keys: Keys = field(init=False)
    up: bool = False  # connected to Redis (written by the supervisor only)
    # set by stop(); every loop checks it, because a cancellation that lands inside a Redis client
    # call can be absorbed by the client, and the loop must still end
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.keys = Keys(self.config.key_prefix)

    @classmethod
    def create(
        cls,
        config: SharedStateConfig,
        registry: CollectorRegistry,
        instance_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> SharedContext:
        if not config.redis_url:
            raise ValueError("shared_state.redis_url is not set")
        return cls(config, SharedStateMetrics(registry), instance_id or default_instance_id(), clock)

    @property
    def origin(self) -> bytes:
        return self.instance_id.encode()

    def block_ms(self) -> int:
        """How long a blocking Redis read waits (the load interval, within 50 ms..1 s)."""
        return max(50, min(1000, int(self.config.load_interval_s * 1000)))

    async def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when the supervisor stops."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)
