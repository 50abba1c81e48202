"""Several gateway instances sharing index and load through Redis (docs/shared-state.md;
docs/architecture.md): the supervisor of the shared-state parts.

Ownership: an agent's stream lands on one instance, the replica's *owner*. Four parts, each the
one writer of its state, wired by the app (``gateway.app_parts.wire_shared_state``):

* ``Publisher`` (gateway/shared_state_publisher.py): the inventory server's observer; queues what
  this instance's agents said and publishes it to each replica's Redis stream.
* ``Follower`` (gateway/shared_state_follower.py): applies the other instances' streams to this
  instance's index, registering their replicas with the fleet.
* ``LoadExchange`` (gateway/shared_state_load.py): publishes this instance's load and adds the
  others' into the fleet.
* ``SharedState`` (here): connection supervision. It alone writes ``up`` and ``stopping``.

Redis keys (``shared_state_codec.Keys``): a STREAM per replica of deltas and snapshot markers
(``XADD MAXLEN ~ stream_maxlen``), a HASH per replica with its latest snapshot and the stream id it
stands at (written with its marker by one Lua script, so the two agree), a HASH per replica with
its registration, a SET of replica ids, a HASH of load per instance (expiring after
``load_ttl_s``) and a SET of instance ids.

Invariants
* Redis going away changes nothing on the request path: the index keeps what it has, the other
  instances' load is forgotten (it would go stale), ``kvgate_shared_state_up`` drops to 0 and a
  log line says so. Reconnection backs off with seeded jitter; on reconnect (or when Redis
  restarted: its run_id changed) owners republish registrations and ask their agents for fresh
  snapshots, and followers reload every replica from its snapshot.
* Tasks: ``start`` creates one supervisor task; each connected session runs three child tasks
  (publisher, follower, load) in a TaskGroup that ends them together. ``stop`` cancels the
  supervisor, which cancels the session and closes its connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.asyncio_tasks import cancel_and_wait
from gateway.shared_state_codec import CodecError
from gateway.shared_state_context import (
    REPLICA_KEYS_TTL_S,
    Redis,
    Restarted,
    SharedContext,
    default_instance_id,
)
from gateway.shared_state_follower import Follower
from gateway.shared_state_load import LoadExchange
from gateway.shared_state_publisher import Publisher

__all__ = ["REPLICA_KEYS_TTL_S", "SharedState", "default_instance_id"]

log = logging.getLogger("kvgate.shared_state")

BACKOFF_BASE_S = 0.1


@dataclass(eq=False, repr=False)  # identity equality and repr, as a service object
class SharedState:
    """Keeps a Redis session up for the publisher, the follower and the load exchange."""

    ctx: SharedContext
    publisher: Publisher
    follower: Follower
    load: LoadExchange
    _rng: random.Random = field(init=False)  # reconnect jitter, seeded by the config
    _task: asyncio.Task[None] | None = field(default=None, init=False)  # the supervisor

    def __post_init__(self) -> None:
        self._rng = random.Random(self.ctx.config.seed)
        self.ctx.metrics.up.set(0)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("shared state already started")
        self._task = asyncio.get_running_loop().create_task(self._supervise(), name="kvgate-shared-state")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            self.ctx.stopping.set()
            self.publisher.wake()
            await cancel_and_wait(task)
        self._set_down(None)

    @property
    def up(self) -> bool:
        return self.ctx.up

    def status(self) -> dict[str, object]:
        return {
            "instance": self.ctx.instance_id,
            "up": self.ctx.up,
            "queue": self.publisher.queued,
            "following": self.follower.following(),
        }

    # ------------------------------------------------------------------ supervision
    async def _supervise(self) -> None:
        ctx, attempt = self.ctx, 0
        while not ctx.stopping.is_set():
            started = time.monotonic()
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except BaseExceptionGroup as group:
                self._failed(_first_cause(group))
            except Exception as exc:
                self._failed(exc)
            if time.monotonic() - started > ctx.config.reconnect_max_s:
                attempt = 0  # the session lived: start the backoff over
            delay = min(ctx.config.reconnect_max_s, BACKOFF_BASE_S * 2**attempt)
            attempt = min(attempt + 1, 30)
            await ctx.pause(delay * (0.5 + 0.5 * self._rng.random()))

    def _client(self) -> Redis:
        block_s = self.ctx.block_ms() / 1000
        url = self.ctx.config.redis_url
        assert url is not None  # SharedContext.create refuses a config without one
        return aioredis.Redis.from_url(
            url,
            socket_connect_timeout=2.0,
            socket_timeout=max(5.0, 4 * block_s),
            # a failure must surface here (down, backoff, resync), not be retried silently
            retry=Retry(NoBackoff(), 0),
            client_name=f"kvgate-{self.ctx.instance_id}",
        )

    async def _session(self) -> None:
        pub, rd = self._client(), self._client()
        try:
            await pub.ping()
            self.load.run_id = str((await pub.info("server"))["run_id"])
            self._set_up()
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.publisher.run(pub), name="kvgate-shared-publish")
                tg.create_task(self.follower.run(rd), name="kvgate-shared-follow")
                tg.create_task(self.load.run(pub), name="kvgate-shared-load")
        finally:
            if self.ctx.up:
                await self.load.withdraw(pub)
            for client in (pub, rd):
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()

    def _failed(self, cause: BaseException) -> None:
        if not isinstance(cause, RedisError | OSError | Restarted | CodecError):
            # a bug, not an outage: say so loudly, then carry on like after an outage
            log.error("shared state: session failed", exc_info=cause)
        self._set_down(cause)

    def _set_up(self) -> None:
        self.ctx.up = True
        self.ctx.metrics.up.set(1)
        log.info("shared state: connected to Redis as instance %s", self.ctx.instance_id)
        self.publisher.connected()
        self.follower.reset()  # followers start over from each replica's snapshot

    def _set_down(self, cause: BaseException | None) -> None:
        was_up = self.ctx.up
        self.ctx.up = False
        self.ctx.metrics.up.set(0)
        self.publisher.disconnected()
        self.load.forget()
        self.follower.disconnected()
        if cause is not None:
            self.ctx.metrics.errors.labels("connection").inc()
            if was_up:
                log.warning(
                    "shared state: Redis unreachable (%s); routing on local state until it is back",
                    str(cause) or type(cause).__name__,
                )
            else:
                log.debug("shared state: Redis still unreachable (%s)", cause)


def _first_cause(group: BaseExceptionGroup[BaseException]) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_cause(exc)
        return exc
    return group
