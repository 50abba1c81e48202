"""Load exchange between gateway instances (docs/shared-state.md): every instance publishes what
it routed and has not finished, per replica (and, for replicas whose agent streams to it, the
engine's own figures), and adds the other instances' figures into its fleet snapshot.

Invariants
* An instance's load key expires after ``load_ttl_s``: an instance that stops or loses Redis stops
  counting; on a clean stop the supervisor withdraws it at once (``withdraw``).
* Each round also refreshes the TTL of the keys of the replicas whose agent streams here, and
  checks Redis's run_id: a restarted Redis (keys lost) ends the session (``Restarted``).
* The fleet's remote load has one writer: this loop (and the supervisor's reset to none when
  Redis goes away).
* Compatible both ways: the TTFT model's queue figures of a replica (pending prefill pairs,
  shared cached tokens, pending age in ms when published) go in a field of their own,
  ``QUEUE_FIELD + replica``, beside the replica's unchanged load value: an older instance reads
  it as a replica whose value does not decode (counted in ``errors{kind="decode"}``) and keeps
  every load it read before; an older writer's load reads as no queue figures.
* Across instances those figures are bounds: shared tokens are the sum of each instance's own
  (a block two instances' flights hold counts in neither: KV demand over-estimated), and the
  pending age is the oldest as published (under-estimated by up to ``load_interval_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Protocol

from redis.exceptions import RedisError

from gateway.fleet import RemoteLoad, ReplicaRecord
from gateway.shared_state_codec import CodecError, LoadFigures, decode_load, encode_load
from gateway.shared_state_context import REPLICA_KEYS_TTL_S, Redis, Restarted, SharedContext
from gateway.shared_state_publisher import AgentStreams

QUEUE_FIELD = "\x00q:"  # hash field of a replica's queue figures: QUEUE_FIELD + replica id


def queue_figures(rec: ReplicaRecord, now: float) -> bytes | None:
    """The TTFT model's queue figures this instance publishes of one replica (None: none)."""
    f = rec.flights
    age = f.pending_age_ms(now)
    if not (f.pending_prefill_pairs or f.shared_tokens or age):
        return None
    return f"{f.pending_prefill_pairs:.1f},{f.shared_tokens},{age:.1f}".encode()


def decode_queue(data: bytes) -> tuple[float, int, float]:
    try:
        pairs, shared, age = data.decode().split(",")[:3]
        return float(pairs), int(shared), float(age)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CodecError(f"malformed queue value {data[:60]!r}: {exc}") from None


class LoadFleet(Protocol):
    def records(self) -> list[ReplicaRecord]: ...

    def now(self) -> float: ...

    def apply_remote_load(self, loads: Mapping[str, RemoteLoad]) -> None: ...


def local_figures(rec: ReplicaRecord) -> LoadFigures | None:
    """What this instance publishes of one replica (None: nothing worth publishing)."""
    if not (rec.in_flight_requests or rec.pending_prefill_tokens or rec.agent_connected):
        return None
    return LoadFigures(
        requests=rec.in_flight_requests,
        tokens=rec.in_flight_tokens,
        prefill=rec.pending_prefill_tokens,
        owned=rec.agent_connected,
        running=rec.engine_running,
        waiting=rec.engine_waiting,
        kv_usage=rec.kv_usage,
    )


class LoadExchange:
    def __init__(self, ctx: SharedContext, fleet: LoadFleet, inventory: AgentStreams) -> None:
        self._ctx = ctx
        self._fleet = fleet
        self._inventory = inventory
        self.run_id: str | None = None  # Redis's run_id when the session started

    async def run(self, client: Redis) -> None:
        ctx = self._ctx
        while not ctx.stopping.is_set():
            await self._publish(client)
            await self._read(client)
            run_id = str((await client.info("server"))["run_id"])
            if run_id != self.run_id:
                raise Restarted(f"Redis restarted (run_id {self.run_id} -> {run_id})")
            await ctx.pause(ctx.config.load_interval_s)

    def forget(self) -> None:
        """Redis is gone: the other instances' load would go stale."""
        self._fleet.apply_remote_load({})

    async def withdraw(self, client: Redis) -> None:
        """Leaving: delete our load so that others stop counting it before its TTL."""
        with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
            await asyncio.wait_for(client.delete(self._ctx.keys.load(self._ctx.instance_id)), 1.0)

    async def _publish(self, client: Redis) -> None:
        ctx, keys = self._ctx, self._ctx.keys
        figures: dict[str, bytes] = {}
        now = self._fleet.now()  # the clock flights start on (the fleet's, injectable)
        for rec in self._fleet.records():
            f = local_figures(rec)
            if f is not None:
                figures[rec.id] = encode_load(f)
            queue = queue_figures(rec, now)
            if queue is not None:
                figures[QUEUE_FIELD + rec.id] = queue
        key = keys.load(ctx.instance_id)
        pipe = client.pipeline(transaction=True)
        pipe.delete(key)
        if figures:
            pipe.hset(key, mapping=figures)  # type: ignore[arg-type]
            pipe.pexpire(key, int(ctx.config.load_ttl_s * 1000))
        pipe.sadd(keys.instances, ctx.instance_id)
        for replica in self._inventory.connected_replicas():
            for name in (keys.stream(replica), keys.snapshot(replica), keys.replica(replica)):
                pipe.expire(name, REPLICA_KEYS_TTL_S)
        await pipe.execute()

    async def _read(self, client: Redis) -> None:
        ctx, keys = self._ctx, self._ctx.keys
        members = sorted(
            m.decode() if isinstance(m, bytes) else str(m) for m in await client.smembers(keys.instances)
        )
        others = [m for m in members if m != ctx.instance_id]
        pipe = client.pipeline(transaction=False)
        for inst in others:
            pipe.hgetall(keys.load(inst))
            pipe.exists(keys.load(inst))
        replies = await pipe.execute() if others else []
        totals: dict[str, list[int]] = {}
        queues: dict[str, list[float]] = {}  # replica -> pairs, shared tokens, oldest age (ms)
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
                    if replica.startswith(QUEUE_FIELD):
                        _add_queue(queues, replica[len(QUEUE_FIELD) :], decode_queue(raw_value))
                        continue
                    f = decode_load(raw_value)
                except CodecError:
                    ctx.metrics.errors.labels("decode").inc()
                    continue
                t = totals.setdefault(replica, [0, 0, 0])
                t[0] += f.requests
                t[1] += f.tokens
                t[2] += f.prefill
                if f.owned:
                    engine[replica] = (f.running, f.waiting, f.kv_usage)
        if gone:
            # an instance without a load key publishes nothing; it re-adds itself next round
            await client.srem(keys.instances, *gone)
        ctx.metrics.instances.set(live)
        now = self._fleet.now()
        loads = {r: RemoteLoad(t[0], t[1], t[2], engine.get(r)) for r, t in totals.items()}
        loads |= {r: RemoteLoad(0, 0, 0, e) for r, e in engine.items() if r not in totals}
        for r, (pairs, shared, age) in queues.items():
            if r in loads:  # queue figures come with the load of the same flights
                oldest = now - age / 1000.0 if age > 0 else None
                loads[r] = dataclasses.replace(
                    loads[r], prefill_pairs=pairs, shared_tokens=int(shared), oldest_pending=oldest
                )
        self._fleet.apply_remote_load(loads)


def _add_queue(queues: dict[str, list[float]], replica: str, figures: tuple[float, int, float]) -> None:
    q = queues.setdefault(replica, [0.0, 0.0, 0.0])
    q[0] += figures[0]
    q[1] += figures[1]
    q[2] = max(q[2], figures[2])
