"""The owner side of shared state (docs/shared-state.md): what this instance's agents said, queued
and published to each replica's Redis stream.

The inventory server tells the publisher (it is the server's ``InventoryObserver``, wired by the
app) of every Hello, snapshot and delta it applied. The hooks append to a bounded queue and return;
the publish loop, run by the supervisor while Redis is up, sends the queue in pipelined batches.

Invariants
* The request path never waits on Redis: hooks never block; the queue holds at most
  ``publish_queue`` entries (drop-oldest, counted; the replica's agent is then asked for a fresh
  snapshot, which heals the followers' gap).
* The publisher is the one writer of the queue and of the per-replica counters ``n``.
* Owners refresh the snapshot (by asking the agent for one) every ``stream_maxlen // 2`` deltas,
  so the latest snapshot's successors are always still in the stream.
* A replica whose agent says Hello here is this instance's to write: ``on_owned`` (the follower's
  ``stop_following``) is called synchronously, before the inventory server applies anything.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from redis.asyncio.client import Pipeline

from gateway.inventory_ops import Op
from gateway.inventory_sink import AgentHello
from gateway.shared_state_codec import Header, encode_header, encode_hello, encode_ops, encode_snapshot
from gateway.shared_state_context import Redis, SharedContext

PUBLISH_BATCH = 256  # entries per pipeline round trip

# KEYS: stream, snapshot hash, replicas set. ARGV: maxlen, origin, n, ts, payload, replica id,
# marker header. One script, so that the snapshot hash always names the stream id of its marker.
_SNAPSHOT_LUA = """
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'h', ARGV[7])
redis.call('HSET', KEYS[2], 'id', id, 'o', ARGV[2], 'n', ARGV[3], 'ts', ARGV[4], 'p', ARGV[5])
redis.call('SADD', KEYS[3], ARGV[6])
return id
"""

_Kind = Literal["delta", "snapshot", "hello"]


class AgentStreams(Protocol):
    """The inventory server, as the shared state sees it."""

    def connected_replicas(self) -> list[str]: ...

    def request_resync(self, replica: str, reason: str = "admin") -> bool: ...


@dataclass(slots=True)
class _Pending:
    kind: _Kind
    replica: str
    n: int
    payload: bytes
    ts: float


class Publisher:
    """Queues this instance's agents' mutations (``InventoryObserver``) and publishes them."""

    def __init__(
        self,
        ctx: SharedContext,
        inventory: AgentStreams,
        max_replicas: int,
        on_owned: Callable[[str], None],
    ) -> None:
        self._ctx = ctx
        self._inventory = inventory
        self._max_replicas = max_replicas
        self._on_owned = on_owned
        # bounded: the queue by publish_queue, the per-replica tables by the index's max_replicas
        # (a new replica's Hello makes room by forgetting those no longer connected here)
        self._queue: deque[_Pending] = deque()
        self._wake = asyncio.Event()
        self._seq: dict[str, int] = {}
        self._since_snapshot: dict[str, int] = {}
        self._refresh_asked: set[str] = set()
        self._hellos: dict[str, AgentHello] = {}

    @property
    def queued(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ hooks (InventoryObserver)
    def inventory_hello(self, hello: AgentHello) -> None:
        # a replica with an agent here is ours to write: stop following it at once
        self._on_owned(hello.replica_id)
        if hello.replica_id not in self._hellos and len(self._hellos) >= self._max_replicas:
            self._forget_disconnected()
            if len(self._hellos) >= self._max_replicas:
                return  # as many agents connected here as the index takes: the fleet refuses it too
        self._hellos[hello.replica_id] = hello
        self._enqueue("hello", hello.replica_id, encode_hello(hello))

    def inventory_snapshot(self, replica: str, entries: Mapping[int, str]) -> None:
        self._since_snapshot[replica] = 0
        self._refresh_asked.discard(replica)
        hello = self._hellos.get(replica)
        if hello is not None:
            # the registration again (snapshots are rare): a Hello dropped from a full queue, or
            # expired keys, come back with the next snapshot
            self._enqueue("hello", replica, encode_hello(hello))
        self._enqueue("snapshot", replica, encode_snapshot(entries))

    def inventory_ops(self, replica: str, ops: Sequence[Op]) -> None:
        payload = encode_ops(ops)
        if not payload:
            return
        self._enqueue("delta", replica, payload)
        count = self._since_snapshot.get(replica, 0) + 1
        self._since_snapshot[replica] = count
        if count >= self._ctx.config.stream_maxlen // 2 and self._ctx.up:
            # keep the latest snapshot inside the stream's retention: followers that fall behind
            # reload it and continue from its marker
            self._refresh(replica)

    def _forget_disconnected(self) -> None:
        """Drop what is kept per replica for those whose agent is no longer connected here, so
        that replicas coming and going (pods replaced under new names) do not fill the tables.
        One that comes back starts its counter ``n`` again: its followers see a gap and reload
        its snapshot, as after a dropped entry."""
        connected = set(self._inventory.connected_replicas())
        for replica in [r for r in self._hellos if r not in connected]:
            del self._hellos[replica]
            self._seq.pop(replica, None)
            self._since_snapshot.pop(replica, None)
            self._refresh_asked.discard(replica)

    def _refresh(self, replica: str) -> None:
        """Ask the replica's agent for a snapshot, once until it comes."""
        if replica not in self._refresh_asked:
            self._refresh_asked.add(replica)
            self._inventory.request_resync(replica, "shared_state")

    def _enqueue(self, kind: _Kind, replica: str, payload: bytes) -> None:
        metrics = self._ctx.metrics
        if not self._ctx.up:
            # the reconnect republishes registrations and asks every agent for a snapshot
            metrics.dropped.labels("down").inc()
            return
        n = self._seq.get(replica, 0) + 1
        self._seq[replica] = n
        if len(self._queue) >= self._ctx.config.publish_queue:
            old = self._queue.popleft()
            metrics.dropped.labels("queue_full").inc()
            self._refresh(old.replica)  # followers see the gap in n; a fresh snapshot heals them
        self._queue.append(_Pending(kind, replica, n, payload, self._ctx.clock()))
        metrics.queue.set(len(self._queue))
        self._wake.set()

    # ------------------------------------------------------------------ connection
    def connected(self) -> None:
        """Redis is (back) up: start over, republishing registrations and asking every agent
        connected here for a fresh snapshot."""
        self._queue.clear()
        self._refresh_asked.clear()
        for replica in self._inventory.connected_replicas():
            hello = self._hellos.get(replica)
            if hello is not None:
                self._enqueue("hello", replica, encode_hello(hello))
            self._refresh(replica)

    def disconnected(self) -> None:
        self._queue.clear()
        self._ctx.metrics.queue.set(0)

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ the loop
    async def run(self, client: Redis) -> None:
        ctx = self._ctx
        while not ctx.stopping.is_set():
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._queue.popleft() for _ in range(min(PUBLISH_BATCH, len(self._queue)))]
            ctx.metrics.queue.set(len(self._queue))
            pipe = client.pipeline(transaction=False)
            for item in batch:
                self._add(pipe, item)
            await pipe.execute()
            for kind in ("delta", "snapshot", "hello"):
                sent = sum(1 for item in batch if item.kind == kind)
                if sent:
                    ctx.metrics.published.labels(kind).inc(sent)

    def _add(self, pipe: Pipeline, item: _Pending) -> None:
        keys, origin, maxlen = self._ctx.keys, self._ctx.origin, self._ctx.config.stream_maxlen
        if item.kind == "delta":
            pipe.xadd(
                keys.stream(item.replica),
                {"h": encode_header(Header(b"d", item.n, item.ts, origin)), "p": item.payload},
                maxlen=maxlen,
                approximate=True,
            )
        elif item.kind == "snapshot":
            pipe.eval(
                _SNAPSHOT_LUA,
                3,
                keys.stream(item.replica),
                keys.snapshot(item.replica),
                keys.replicas,
                maxlen,
                origin,
                item.n,
                repr(item.ts),
                item.payload,
                item.replica,
                encode_header(Header(b"S", item.n, item.ts, origin)),
            )
        else:
            pipe.hset(keys.replica(item.replica), mapping={"hello": item.payload, "o": origin})
            pipe.sadd(keys.replicas, item.replica)
