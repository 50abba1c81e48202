"""Several gateway instances sharing index and load through Redis (docs/shared-state.md).

Ownership: an agent's stream lands on one instance, the replica's *owner*. The owner's inventory
server applies the agent's mutations to its own index and tells this object (``InventoryObserver``
hooks), which queues them and publishes them to the replica's Redis stream. Every other instance
follows that stream and applies it to its own index, so every instance routes by every replica's
cache. Load: every instance publishes what it routed and has not finished, per replica, and adds
the other instances' figures into its fleet snapshot.

Redis keys (``shared_state_codec.Keys``): a STREAM per replica of deltas and snapshot markers
(``XADD MAXLEN ~ stream_maxlen``), a HASH per replica with its latest snapshot and the stream id it
stands at (written with its marker by one Lua script, so the two agree), a HASH per replica with
its registration, a SET of replica ids, a HASH of load per instance (expiring after
``load_ttl_s``) and a SET of instance ids.

Invariants
* One writer per replica in each instance's index: a replica with an agent stream here is written
  by the inventory server only; the follower task writes the others, and checks ownership after
  every await before it applies anything. An index mutation never awaits.
* The request path never waits on Redis: the hooks append to a bounded queue (drop-oldest,
  counted) and return; routing reads only in-memory state.
* Each entry carries its origin instance and a per-replica counter ``n``; a follower that sees a
  gap (dropped entries, a trimmed stream, a new owner) reloads the replica's latest snapshot, or
  ignores deltas until the next snapshot marker. Owners refresh the snapshot (by asking the agent
  for one) every ``stream_maxlen // 2`` deltas, so the latest snapshot's successors are always
  still in the stream.
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
import os
import random
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import orjson
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.config import SharedStateConfig
from gateway.fleet import Fleet, RemoteLoad
from gateway.inventory_server import InventoryServer
from gateway.inventory_sink import AgentHello
from gateway.shared_state_codec import (
    CodecError,
    Header,
    Keys,
    LoadFigures,
    SnapshotBoundError,
    decode_header,
    decode_load,
    decode_ops,
    decode_snapshot,
    encode_header,
    encode_load,
    encode_ops,
    encode_snapshot,
    ops_of_events,
    parse_stream_id,
)
from gateway.shared_state_metrics import SharedStateMetrics
from proto.kvgate.v1 import inventory_pb2 as pb
from router_policies.prefix_index import IndexBoundError, PrefixIndex

log = logging.getLogger("kvgate.shared_state")

PUBLISH_BATCH = 256  # entries per pipeline round trip
READ_COUNT = 256  # entries per stream per XREAD
BACKOFF_BASE_S = 0.1
# A replica's keys (stream, snapshot, registration) live this long after the last instance holding
# its agent refreshed them (every load round): a replica gone for good leaves nothing behind.
REPLICA_KEYS_TTL_S = 3600

# KEYS: stream, snapshot hash, replicas set. ARGV: maxlen, origin, n, ts, payload, replica id,
# marker header. One script, so that the snapshot hash always names the stream id of its marker.
_SNAPSHOT_LUA = """
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'h', ARGV[7])
redis.call('HSET', KEYS[2], 'id', id, 'o', ARGV[2], 'n', ARGV[3], 'ts', ARGV[4], 'p', ARGV[5])
redis.call('SADD', KEYS[3], ARGV[6])
return id
"""

Redis = aioredis.Redis
# replies as this client returns them (decode_responses off: bytes throughout)
_XReadReply = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]


class _Restarted(Exception):
    """Redis answered with a new run_id: it restarted, and (without persistence) lost our keys."""


@dataclass(slots=True)
class _Pending:
    kind: Literal["delta", "snapshot", "hello"]
    replica: str
    n: int
    payload: bytes
    ts: float


@dataclass(slots=True)
class _Follow:
    """How far this instance has applied one remote replica's stream."""

    pos: tuple[int, int] = (0, 0)
    origin: bytes = b""
    n: int = 0
    synced: bool = False  # deltas apply only on top of a snapshot


def _id_text(pos: tuple[int, int]) -> str:
    return f"{pos[0]}-{pos[1]}"


def default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class SharedState:
    """Publishes this instance's agents' inventories and load to Redis and follows the others'."""

    def __init__(
        self,
        config: SharedStateConfig,
        index: PrefixIndex,
        fleet: Fleet,
        inventory: InventoryServer,
        registry: CollectorRegistry,
        *,
        instance_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not config.redis_url:
            raise ValueError("shared_state.redis_url is not set")
        self._cfg = config
        self._url = config.redis_url
        self._keys = Keys(config.key_prefix)
        self._index = index
        self._fleet = fleet
        self._inventory = inventory
        inventory.observer = self  # every applied delta and snapshot reaches us
        self.metrics = SharedStateMetrics(registry)
        self._applied_delta = self.metrics.applied.labels("delta")  # per entry: skip the lookup
        self.instance_id = instance_id or default_instance_id()
        self._origin = self.instance_id.encode()
        self._clock = clock
        self._rng = random.Random(config.seed)
        self._up = False
        self._run_id: str | None = None
        # publishing (owner side); bounded: queue by publish_queue, dicts by the index's max_replicas
        self._queue: deque[_Pending] = deque()
        self._wake = asyncio.Event()
        # set by stop(); every loop checks it, because a cancellation that lands inside a Redis
        # client call can be absorbed by the client, and the loop must still end
        self._stopping = asyncio.Event()
        self._seq: dict[str, int] = {}
        self._since_snapshot: dict[str, int] = {}
        self._refresh_asked: set[str] = set()
        self._hellos: dict[str, AgentHello] = {}
        # following (reader side); bounded by the index's max_replicas
        self._follow: dict[str, _Follow] = {}
        self._refused: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self.metrics.up.set(0)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("shared state already started")
        self._task = asyncio.get_running_loop().create_task(self._supervise(), name="kvgate-shared-state")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            self._stopping.set()
            self._wake.set()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._set_down(None)

    @property
    def up(self) -> bool:
        return self._up

    def status(self) -> dict[str, object]:
        return {
            "instance": self.instance_id,
            "up": self._up,
            "queue": len(self._queue),
            "following": sorted(r for r, f in self._follow.items() if f.synced),
        }

    # ------------------------------------------------------------------ hooks (InventoryObserver)
    def inventory_hello(self, hello: AgentHello) -> None:
        if hello.replica_id not in self._hellos and len(self._hellos) >= self._index.config.max_replicas:
            return
        self._hellos[hello.replica_id] = hello
        # a replica with an agent here is ours to write: stop following it at once
        if self._follow.pop(hello.replica_id, None) is not None:
            self._fleet.set_shared_inventory(hello.replica_id, False)
            self.metrics.remote_replicas.set(len(self._follow))
        self._enqueue("hello", hello.replica_id, _encode_hello(hello))

    def inventory_snapshot(self, replica: str, entries: Mapping[int, str]) -> None:
        self._since_snapshot[replica] = 0
        self._refresh_asked.discard(replica)
        hello = self._hellos.get(replica)
        if hello is not None:
            # the registration again (snapshots are rare): a Hello dropped from a full queue, or
            # expired keys, come back with the next snapshot
            self._enqueue("hello", replica, _encode_hello(hello))
        self._enqueue("snapshot", replica, encode_snapshot(entries))

    def inventory_events(self, replica: str, events: Sequence[pb.Event]) -> None:
        payload = encode_ops(ops_of_events(events))
        if not payload:
            return
        self._enqueue("delta", replica, payload)
        count = self._since_snapshot.get(replica, 0) + 1
        self._since_snapshot[replica] = count
        if count >= self._cfg.stream_maxlen // 2 and replica not in self._refresh_asked and self._up:
            # keep the latest snapshot inside the stream's retention: followers that fall behind
            # reload it and continue from its marker
            self._refresh_asked.add(replica)
            self._inventory.request_resync(replica, "shared_state")

    def _enqueue(self, kind: Literal["delta", "snapshot", "hello"], replica: str, payload: bytes) -> None:
        if not self._up:
            # the reconnect republishes registrations and asks every agent for a snapshot
            self.metrics.dropped.labels("down").inc()
            return
        n = self._seq.get(replica, 0) + 1
        self._seq[replica] = n
        if len(self._queue) >= self._cfg.publish_queue:
            old = self._queue.popleft()
            self.metrics.dropped.labels("queue_full").inc()
            # followers see the gap in n; a fresh snapshot heals them
            if old.replica not in self._refresh_asked:
                self._refresh_asked.add(old.replica)
                self._inventory.request_resync(old.replica, "shared_state")
        self._queue.append(_Pending(kind, replica, n, payload, self._clock()))
        self.metrics.queue.set(len(self._queue))
        self._wake.set()

    # ------------------------------------------------------------------ supervision
    async def _supervise(self) -> None:
        attempt = 0
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except BaseExceptionGroup as group:
                self._failed(_first_cause(group))
            except Exception as exc:
                self._failed(exc)
            if time.monotonic() - started > self._cfg.reconnect_max_s:
                attempt = 0  # the session lived: start the backoff over
            delay = min(self._cfg.reconnect_max_s, BACKOFF_BASE_S * 2**attempt)
            attempt = min(attempt + 1, 30)
            await self._pause(delay * (0.5 + 0.5 * self._rng.random()))

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when stop() is called."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    def _client(self) -> Redis:
        block_s = self._block_ms() / 1000
        return aioredis.Redis.from_url(
            self._url,
            socket_connect_timeout=2.0,
            socket_timeout=max(5.0, 4 * block_s),
            # a failure must surface here (down, backoff, resync), not be retried silently
            retry=Retry(NoBackoff(), 0),
            client_name=f"kvgate-{self.instance_id}",
        )

    def _block_ms(self) -> int:
        return max(50, min(1000, int(self._cfg.load_interval_s * 1000)))

    async def _session(self) -> None:
        pub, rd = self._client(), self._client()
        try:
            await pub.ping()
            self._run_id = str((await pub.info("server"))["run_id"])
            self._set_up()
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._publish_loop(pub), name="kvgate-shared-publish")
                tg.create_task(self._follow_loop(rd), name="kvgate-shared-follow")
                tg.create_task(self._load_loop(pub), name="kvgate-shared-load")
        finally:
            if self._up:
                # leaving (stop): withdraw our load so others stop counting it before its TTL
                with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
                    await asyncio.wait_for(pub.delete(self._keys.load(self.instance_id)), 1.0)
            for client in (pub, rd):
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()

    def _failed(self, cause: BaseException) -> None:
        if not isinstance(cause, RedisError | OSError | _Restarted | CodecError):
            # a bug, not an outage: say so loudly, then carry on like after an outage
            log.error("shared state: session failed", exc_info=cause)
        self._set_down(cause)

    def _set_up(self) -> None:
        self._up = True
        self.metrics.up.set(1)
        log.info("shared state: connected to Redis as instance %s", self.instance_id)
        self._queue.clear()
        self._refresh_asked.clear()
        for replica in self._inventory.connected_replicas():
            hello = self._hellos.get(replica)
            if hello is not None:
                self._enqueue("hello", replica, _encode_hello(hello))
            self._refresh_asked.add(replica)
            self._inventory.request_resync(replica, "shared_state")
        # followers start over from each replica's snapshot
        for replica in self._follow:
            self._fleet.set_shared_inventory(replica, False)
        self._follow.clear()

    def _set_down(self, cause: BaseException | None) -> None:
        was_up = self._up
        self._up = False
        self.metrics.up.set(0)
        self._queue.clear()
        self.metrics.queue.set(0)
        self._fleet.apply_remote_load({})
        for replica in self._follow:
            self._fleet.set_shared_inventory(replica, False)
        if cause is not None:
            self.metrics.errors.labels("connection").inc()
            if was_up:
                log.warning(
                    "shared state: Redis unreachable (%s); routing on local state until it is back",
                    str(cause) or type(cause).__name__,
                )
            else:
                log.debug("shared state: Redis still unreachable (%s)", cause)

    # ------------------------------------------------------------------ publishing
    async def _publish_loop(self, client: Redis) -> None:
        keys = self._keys
        maxlen = self._cfg.stream_maxlen
        while not self._stopping.is_set():
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._queue.popleft() for _ in range(min(PUBLISH_BATCH, len(self._queue)))]
            self.metrics.queue.set(len(self._queue))
            pipe = client.pipeline(transaction=False)
            origin = self._origin
            for item in batch:
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
            await pipe.execute()
            for kind in ("delta", "snapshot", "hello"):
                sent = sum(1 for item in batch if item.kind == kind)
                if sent:
                    self.metrics.published.labels(kind).inc(sent)

    # ------------------------------------------------------------------ following
    async def _follow_loop(self, client: Redis) -> None:
        keys = self._keys
        while not self._stopping.is_set():
            await self._discover(client)
            streams: dict[Any, Any] = {keys.stream(r): _id_text(f.pos) for r, f in self._follow.items()}
            if not streams:
                await self._pause(self._cfg.load_interval_s)
                continue
            reply = cast(
                "_XReadReply | None", await client.xread(streams, count=READ_COUNT, block=self._block_ms())
            )
            prefix = len(keys.stream(""))
            for raw_name, entries in reply or []:
                name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
                await self._apply_entries(client, name[prefix:], entries)

    async def _discover(self, client: Redis) -> None:
        members = await client.smembers(self._keys.replicas)
        owned = set(self._inventory.connected_replicas())
        for raw in sorted(members):
            replica = raw.decode() if isinstance(raw, bytes) else str(raw)
            if replica in owned or replica in self._follow or replica in self._refused:
                continue
            if len(self._follow) + len(owned) >= self._index.config.max_replicas:
                break
            if not await self._register(client, replica):
                continue
            if replica in self._inventory.connected_replicas():
                continue  # its agent connected here meanwhile
            follow = _Follow()
            self._follow[replica] = follow
            await self._reload(client, replica, follow, "bootstrap")
        self.metrics.remote_replicas.set(len(self._follow))

    async def _register(self, client: Redis, replica: str) -> bool:
        """Make the replica routable here from its shared registration (a no-op for one we know)."""
        raw = cast("bytes | None", await client.hget(self._keys.replica(replica), "hello"))
        if raw is None:
            # its keys expired (no agent anywhere for REPLICA_KEYS_TTL_S): forget the id; an owner
            # publishes the Hello (HSET, then SADD) before anything else of a replica
            await client.srem(self._keys.replicas, replica)
            return False
        try:
            hello = _decode_hello(raw)
        except CodecError as exc:
            self.metrics.errors.labels("decode").inc()
            log.warning("shared state: registration of %r does not decode: %s", replica, exc)
            return False
        refusal = self._fleet.agent_hello(hello)
        if refusal is not None:
            self._refused.add(replica)
            self.metrics.errors.labels("refused_replica").inc()
            log.warning("shared state: not following replica %r: %s", replica, refusal)
            return False
        return True

    async def _reload(self, client: Redis, replica: str, follow: _Follow, reason: str) -> None:
        """Replace the replica's precise entries by its latest snapshot when that is newer than
        what was applied; otherwise wait for the next snapshot marker (deltas are ignored)."""
        raw = cast("dict[bytes, bytes]", await client.hgetall(self._keys.snapshot(replica)))
        if self._follow.get(replica) is not follow:
            return  # owned here now, or the session restarted, while we awaited
        if not raw or b"id" not in raw:
            follow.synced = False
            return
        try:
            pos = parse_stream_id(raw[b"id"])
            n = int(raw[b"n"])
            if follow.synced and pos <= follow.pos:
                return
            if pos <= follow.pos:
                follow.synced = False
                return
            entries = decode_snapshot(raw[b"p"], self._index.config.max_blocks_per_replica)
            self._index.replace_replica(replica, entries)
        except (IndexBoundError, SnapshotBoundError) as exc:
            self.metrics.errors.labels("index_bound").inc()
            log.warning("shared state: snapshot of %r refused by the index: %s", replica, exc)
            follow.synced = False
            return
        except (CodecError, KeyError, ValueError) as exc:
            self.metrics.errors.labels("decode").inc()
            log.warning("shared state: snapshot of %r does not decode: %s", replica, exc)
            follow.synced = False
            return
        follow.pos, follow.origin, follow.n, follow.synced = pos, raw.get(b"o", b""), n, True
        self._fleet.set_shared_inventory(replica, True)
        self.metrics.applied.labels("snapshot").inc()
        self.metrics.resyncs.labels(reason).inc()
        self._observe_lag(raw.get(b"ts"))

    async def _apply_entries(
        self, client: Redis, replica: str, entries: Sequence[tuple[bytes, dict[bytes, bytes]]]
    ) -> None:
        for raw_id, fields in entries:
            follow = self._follow.get(replica)
            if follow is None:
                return  # owned here now
            pos = parse_stream_id(raw_id)
            if pos <= follow.pos:
                continue  # covered by a snapshot loaded meanwhile
            try:
                head = decode_header(fields.get(b"h", b""))
            except CodecError as exc:
                self.metrics.errors.labels("decode").inc()
                log.warning("shared state: entry %s of %r: %s", raw_id, replica, exc)
                head = Header(b"d", -1, 0.0, b"")  # treated as a gap
            if head.kind == b"S":
                await self._reload(client, replica, follow, "marker")
                if follow.pos < pos:
                    follow.pos = pos
                continue
            origin, n = head.origin, head.n
            in_order = follow.synced and origin == follow.origin and n == follow.n + 1
            if not in_order and follow.synced:
                # entries were lost (dropped by the owner, trimmed, or a new owner): a snapshot
                # newer than what we applied puts us right; else wait for the next marker
                await self._reload(client, replica, follow, "gap")
                if self._follow.get(replica) is not follow:
                    return
                if follow.pos >= pos:
                    continue
                in_order = follow.synced and origin == follow.origin and n == follow.n + 1
            if not in_order:
                follow.synced = False
                follow.pos = pos
                continue
            follow.pos, follow.n = pos, n
            # no await since the ownership check above: inventory_hello drops a replica from
            # self._follow synchronously when its agent connects here
            self._apply_delta(replica, follow, fields.get(b"p", b""))
            self.metrics.lag.set(max(0.0, self._clock() - head.ts))

    def _apply_delta(self, replica: str, follow: _Follow, payload: bytes) -> None:
        index = self._index
        try:
            for op in decode_ops(payload):
                if op.kind == "s":
                    index.store(replica, op.keys, op.medium)
                elif op.kind == "r":
                    index.remove(replica, op.keys)
                else:
                    index.clear_replica(replica)
        except CodecError as exc:
            self.metrics.errors.labels("decode").inc()
            log.warning("shared state: delta of %r does not decode: %s", replica, exc)
            follow.synced = False  # the next snapshot marker puts it right
            return
        except IndexBoundError as exc:
            self.metrics.errors.labels("index_bound").inc()
            log.warning("shared state: delta of %r refused by the index: %s", replica, exc)
            follow.synced = False
            return
        self._applied_delta.inc()

    def _observe_lag(self, ts: bytes | None) -> None:
        if ts:
            with contextlib.suppress(ValueError):
                self.metrics.lag.set(max(0.0, self._clock() - float(ts)))

    # ------------------------------------------------------------------ load
    async def _load_loop(self, client: Redis) -> None:
        while not self._stopping.is_set():
            await self._publish_load(client)
            await self._read_load(client)
            run_id = str((await client.info("server"))["run_id"])
            if run_id != self._run_id:
                raise _Restarted(f"Redis restarted (run_id {self._run_id} -> {run_id})")
            await self._pause(self._cfg.load_interval_s)

    async def _publish_load(self, client: Redis) -> None:
        figures: dict[str, bytes] = {}
        for rec in self._fleet.records():
            if not (rec.in_flight_requests or rec.pending_prefill_tokens or rec.agent_connected):
                continue
            figures[rec.id] = encode_load(
                LoadFigures(
                    requests=rec.in_flight_requests,
                    tokens=rec.in_flight_tokens,
                    prefill=rec.pending_prefill_tokens,
                    owned=rec.agent_connected,
                    running=rec.engine_running,
                    waiting=rec.engine_waiting,
                    kv_usage=rec.kv_usage,
                )
            )
        key = self._keys.load(self.instance_id)
        pipe = client.pipeline(transaction=True)
        pipe.delete(key)
        if figures:
            pipe.hset(key, mapping=figures)  # type: ignore[arg-type]
            pipe.pexpire(key, int(self._cfg.load_ttl_s * 1000))
        pipe.sadd(self._keys.instances, self.instance_id)
        keys = self._keys
        for replica in self._inventory.connected_replicas():
            for name in (keys.stream(replica), keys.snapshot(replica), keys.replica(replica)):
                pipe.expire(name, REPLICA_KEYS_TTL_S)
        await pipe.execute()

    async def _read_load(self, client: Redis) -> None:
        members = sorted(
            m.decode() if isinstance(m, bytes) else str(m)
            for m in await client.smembers(self._keys.instances)
        )
        others = [m for m in members if m != self.instance_id]
        pipe = client.pipeline(transaction=False)
        for inst in others:
            pipe.hgetall(self._keys.load(inst))
            pipe.exists(self._keys.load(inst))
        replies = await pipe.execute() if others else []
        totals: dict[str, list[int]] = {}
        engine: dict[str, tuple[int, int, float]] = {}
        gone: list[str] = []
        live = 0
        for i, inst in enumerate(others):
            doc, exists = replies[2 * i], replies[2 * i + 1]
            if not exists:
                gone.append(inst)  # its load expired: the instance stopped or lost Redis
                continue
            live += 1
            for raw_replica, raw_value in doc.items():
                replica = raw_replica.decode()
                try:
                    f = decode_load(raw_value)
                except CodecError:
                    self.metrics.errors.labels("decode").inc()
                    continue
                t = totals.setdefault(replica, [0, 0, 0])
                t[0] += f.requests
                t[1] += f.tokens
                t[2] += f.prefill
                if f.owned:
                    engine[replica] = (f.running, f.waiting, f.kv_usage)
        if gone:
            # an instance without a load key publishes nothing; it re-adds itself next round
            await client.srem(self._keys.instances, *gone)
        self.metrics.instances.set(live)
        self._fleet.apply_remote_load(
            {r: RemoteLoad(t[0], t[1], t[2], engine.get(r)) for r, t in totals.items()}
            | {r: RemoteLoad(0, 0, 0, e) for r, e in engine.items() if r not in totals}
        )


def _encode_hello(h: AgentHello) -> bytes:
    return orjson.dumps(
        {
            "replica_id": h.replica_id,
            "url": h.url,
            "models": list(h.models),
            "block_size": h.block_size,
            "capacity_blocks": h.capacity_blocks,
            "engine": h.engine,
            "engine_version": h.engine_version,
            "agent_version": h.agent_version,
        }
    )


def _decode_hello(raw: bytes) -> AgentHello:
    try:
        d = orjson.loads(raw)
        return AgentHello(
            replica_id=str(d["replica_id"]),
            url=str(d["url"]),
            models=tuple(str(m) for m in d["models"]),
            block_size=int(d["block_size"]),
            capacity_blocks=int(d["capacity_blocks"]),
            engine=str(d["engine"]),
            engine_version=str(d["engine_version"]),
            agent_version=str(d["agent_version"]),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CodecError(f"malformed registration: {exc}") from None


def _first_cause(group: BaseExceptionGroup[BaseException]) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_cause(exc)
        return exc
    return group
