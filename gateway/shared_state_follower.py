"""The reader side of shared state (docs/shared-state.md): the other instances' replicas, followed
through Redis into this instance's index.

Invariants
* One writer per replica in this instance's index: a replica with an agent stream here is written
  by the inventory server only; the follower writes the others. The publisher calls
  ``stop_following`` synchronously when an agent says Hello here, and the follower checks that it
  still follows a replica after every await before it applies anything. An index mutation never
  awaits.
* Each stream entry carries its origin instance and a per-replica counter ``n``; a gap (dropped
  entries, a trimmed stream, a new owner) reloads the replica's latest snapshot, or deltas are
  ignored until the next snapshot marker.
* Remote replicas enter the fleet through ``RemoteReplicas.register_remote`` (not as if an agent
  had said Hello here): the fleet owns the replica set.
* The follow table is bounded by the index's ``max_replicas``; the follower is its one writer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from gateway.inventory_ops import IndexReplica, apply_ops
from gateway.inventory_sink import AgentHello
from gateway.shared_state_codec import (
    CodecError,
    Header,
    SnapshotBoundError,
    decode_header,
    decode_hello,
    decode_ops,
    decode_snapshot,
    parse_stream_id,
)
from gateway.shared_state_context import Redis, SharedContext
from gateway.shared_state_publisher import AgentStreams
from router_policies.placement import replace_snapshot
from router_policies.prefix_index import IndexBoundError, PrefixIndex

log = logging.getLogger("kvgate.shared_state")

READ_COUNT = 256  # entries per stream per XREAD

# replies as this client returns them (decode_responses off: bytes throughout)
_XReadReply = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]


class RemoteReplicas(Protocol):
    """What the follower asks of the fleet."""

    def register_remote(self, hello: AgentHello) -> str | None:
        """Make routable a replica whose agent streams to another instance (its shared
        registration); None, or why it is refused."""
        ...

    def set_shared_inventory(self, replica_id: str, shared: bool) -> None: ...

    def snapshot_keep(self) -> tuple[float, float]:
        """(now, lifetime_s) for the entries a snapshot drops (``Fleet.snapshot_keep``)."""
        ...


@dataclass(slots=True)
class _Follow:
    """How far this instance has applied one remote replica's stream."""

    pos: tuple[int, int] = (0, 0)
    origin: bytes = b""
    n: int = 0
    synced: bool = False  # deltas apply only on top of a snapshot


def _id_text(pos: tuple[int, int]) -> str:
    return f"{pos[0]}-{pos[1]}"


@dataclass(eq=False, repr=False)  # identity equality and repr, as a service object
class Follower:
    ctx: SharedContext
    index: PrefixIndex
    fleet: RemoteReplicas
    inventory: AgentStreams
    _follow: dict[str, _Follow] = field(default_factory=dict, init=False)
    _refused: set[str] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self._applied_delta = self.ctx.metrics.applied.labels("delta")  # per entry: skip the lookup

    def following(self) -> list[str]:
        return sorted(r for r, f in self._follow.items() if f.synced)

    def stop_following(self, replica: str) -> None:
        """An agent for ``replica`` connected here: the inventory server writes it from now on."""
        if self._follow.pop(replica, None) is not None:
            self.fleet.set_shared_inventory(replica, False)
            self.ctx.metrics.remote_replicas.set(len(self._follow))

    def reset(self) -> None:
        """Forget every followed replica (a new session reloads each from its snapshot)."""
        self.disconnected()
        self._follow.clear()

    def disconnected(self) -> None:
        for replica in self._follow:
            self.fleet.set_shared_inventory(replica, False)

    # ------------------------------------------------------------------ the loop
    async def run(self, client: Redis) -> None:
        ctx, keys = self.ctx, self.ctx.keys
        while not ctx.stopping.is_set():
            await self._discover(client)
            streams: dict[Any, Any] = {keys.stream(r): _id_text(f.pos) for r, f in self._follow.items()}
            if not streams:
                await ctx.pause(ctx.config.load_interval_s)
                continue
            reply = cast(
                "_XReadReply | None", await client.xread(streams, count=READ_COUNT, block=ctx.block_ms())
            )
            prefix = len(keys.stream(""))
            for raw_name, entries in reply or []:
                name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
                await self._apply_entries(client, name[prefix:], entries)

    async def _discover(self, client: Redis) -> None:
        members = await client.smembers(self.ctx.keys.replicas)
        owned = set(self.inventory.connected_replicas())
        for raw in sorted(members):
            replica = raw.decode() if isinstance(raw, bytes) else str(raw)
            if replica in owned or replica in self._follow or replica in self._refused:
                continue
            if len(self._follow) + len(owned) >= self.index.config.max_replicas:
                break
            if not await self._register(client, replica):
                continue
            if replica in self.inventory.connected_replicas():
                continue  # its agent connected here meanwhile
            follow = _Follow()
            self._follow[replica] = follow
            await self._reload(client, replica, follow, "bootstrap")
        self.ctx.metrics.remote_replicas.set(len(self._follow))

    async def _register(self, client: Redis, replica: str) -> bool:
        """Make the replica routable here from its shared registration (a no-op for one we know)."""
        keys, metrics = self.ctx.keys, self.ctx.metrics
        raw = cast("bytes | None", await client.hget(keys.replica(replica), "hello"))
        if raw is None:
            # its keys expired (no agent anywhere for REPLICA_KEYS_TTL_S): forget the id; an owner
            # publishes the Hello (HSET, then SADD) before anything else of a replica
            await client.srem(keys.replicas, replica)
            return False
        try:
            hello = decode_hello(raw)
        except CodecError as exc:
            metrics.errors.labels("decode").inc()
            log.warning("shared state: registration of %r does not decode: %s", replica, exc)
            return False
        refusal = self.fleet.register_remote(hello)
        if refusal is not None:
            self._refused.add(replica)
            metrics.errors.labels("refused_replica").inc()
            log.warning("shared state: not following replica %r: %s", replica, refusal)
            return False
        return True

    async def _reload(self, client: Redis, replica: str, follow: _Follow, reason: str) -> None:
        """Replace the replica's precise entries by its latest snapshot when that is newer than
        what was applied; otherwise wait for the next snapshot marker (deltas are ignored)."""
        metrics = self.ctx.metrics
        raw = cast("dict[bytes, bytes]", await client.hgetall(self.ctx.keys.snapshot(replica)))
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
            entries = decode_snapshot(raw[b"p"], self.index.config.max_blocks_per_replica)
            replace_snapshot(self.index, replica, entries, self.fleet.snapshot_keep())
        except (IndexBoundError, SnapshotBoundError) as exc:
            self._refuse(follow, "index_bound", f"snapshot of {replica!r} refused by the index: {exc}")
            return
        except (CodecError, KeyError, ValueError) as exc:
            self._refuse(follow, "decode", f"snapshot of {replica!r} does not decode: {exc}")
            return
        follow.pos, follow.origin, follow.n, follow.synced = pos, raw.get(b"o", b""), n, True
        self.fleet.set_shared_inventory(replica, True)
        metrics.applied.labels("snapshot").inc()
        metrics.resyncs.labels(reason).inc()
        ts = raw.get(b"ts")
        if ts:
            with contextlib.suppress(ValueError):
                metrics.lag.set(max(0.0, self.ctx.clock() - float(ts)))

    def _refuse(self, follow: _Follow, kind: str, message: str) -> None:
        """Count and log a remote entry that cannot apply; deltas wait for the next snapshot."""
        self.ctx.metrics.errors.labels(kind).inc()
        log.warning("shared state: %s", message)
        follow.synced = False

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
                self.ctx.metrics.errors.labels("decode").inc()
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
            # no await since the ownership check above: stop_following drops a replica from
            # self._follow synchronously when its agent connects here
            self._apply_delta(replica, follow, fields.get(b"p", b""))
            self.ctx.metrics.lag.set(max(0.0, self.ctx.clock() - head.ts))

    def _apply_delta(self, replica: str, follow: _Follow, payload: bytes) -> None:
        try:
            ops = list(decode_ops(payload))  # whole or nothing: decoded before any is applied
            apply_ops(ops, IndexReplica(self.index, replica))
        except CodecError as exc:
            self._refuse(follow, "decode", f"delta of {replica!r} does not decode: {exc}")
            return
        except IndexBoundError as exc:
            self._refuse(follow, "index_bound", f"delta of {replica!r} refused by the index: {exc}")
            return
        self._applied_delta.inc()
