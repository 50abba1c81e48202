"""The inventory owner's side of the local channel to its HTTP workers (``kvgate serve --workers
N``; docs/architecture.md, "Workers").

The parent process holds the authoritative index and fleet: its inventory server applies the
agents' streams (bound checks as with one process) and its health checker probes the replicas.
``OwnerFleet`` (the fleet the parent's inventory server and health checker write) and ``Hub`` (the
inventory server's observer) turn every mutation they apply into a frame
(gateway/local_hub_codec.py), written to every worker's unix-socket connection in the order it
was applied. A worker (re)connecting gets, in one synchronous step, the whole state (every
replica's registration, link, engine, health, precise and speculative entries, the others' load)
and then the live frames, so it misses none and sees none twice.

Workers send their speculative touches (applied here, then relayed to the other workers), their
in-flight load (summed per replica over the other workers and sent to each), held-prefix hints
(to the replica's agent), reloads (applied here and relayed) and metrics requests (every worker's
exposition gathered and merged, gateway/workers_metrics.py).

Invariants
* One writer: the parent's index and fleet are written by the inventory server, the health
  checker and ``Hub`` on one event loop; no mutation awaits. Frames are queued synchronously
  right after the mutation they describe, so every worker applies the same sequence.
* Every buffer is bounded: a worker's pending output beyond ``MAX_PENDING_BYTES`` (plus the
  size of the initial state it was sent) closes its connection (the worker exits and is
  restarted, then resynced from a full state); a frame is at most ``frame_bound`` bytes.
* Relayed speculative touches are applied here in batches, then relayed in the order applied
  (gateway/local_hub_touch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from gateway.asyncio_tasks import TaskSet
from gateway.config import GatewayConfig
from gateway.fleet import Fleet
from gateway.inventory_ops import MAX_MESSAGE_BYTES, OPS_FRAME_EXPANSION, Op
from gateway.inventory_sink import AgentEngine, AgentHello, AgentLoad
from gateway.local_hub_codec import (
    FrameWriter,
    decode_json,
    decode_tagged,
    decode_touch,
    encode_json,
    encode_replica,
    encode_stamps,
    encode_tagged,
    frame,
    read_frame,
)
from gateway.local_hub_load import LoadTable
from gateway.local_hub_touch import TOUCH_WINDOW_S, Touch, TouchBatcher
from gateway.shared_state_codec import CodecError, encode_hello, encode_ops, encode_snapshot
from gateway.workers_metrics import merge_expositions
from gateway.workers_ttft import decode_observation, fit_frame, warm_up
from router_policies.prefix_index import PrefixIndex

log = logging.getLogger("kvgate.workers")

MAX_PENDING_BYTES = 256 * 1024 * 1024  # a worker this far behind is restarted and resynced
METRICS_WAIT_S = 2.0  # how long a metrics gather waits for the workers' answers
LOAD_RELAY_S = 0.01  # the workers' load is relayed at most this often
# a replica's fit is published at most this often: the fits of the first tokens of one window
# go out as one (the last) rather than one frame to every worker per first token
FIT_PUBLISH_S = 0.01


def frame_bound(index: PrefixIndex) -> int:
    """The largest frame either side sends: a snapshot of a full replica (9 bytes a key, plus the
    speculative entries' 16) or the ops of the largest agent message the stream accepts (its
    removals are not bounded by the replica's blocks), with headroom for the control frames."""
    cfg = index.config
    snapshot = 16 * cfg.max_blocks_per_replica + 16 * cfg.approximate_blocks_per_replica
    return max(snapshot, OPS_FRAME_EXPANSION * MAX_MESSAGE_BYTES) + (1 << 20)


def engine_frame(replica: str, engine: AgentEngine) -> bytes:
    return encode_json(b"E", [replica, engine.hybrid, sorted(engine.lora_adapters), engine.adapters_known])


class OwnerFleet(Fleet):
    """The parent's fleet: every agent and health-check input it applies is relayed to the
    workers (``relay``, set by the hub), after it was applied here."""

    def __init__(self, config: GatewayConfig, index: PrefixIndex) -> None:
        super().__init__(config, index)
        self.relay: Callable[[bytes], None] = lambda _frame: None
        self.hellos: dict[str, AgentHello] = {}  # accepted registrations (bounded by the fleet)

    def agent_hello(self, hello: AgentHello) -> str | None:
        refusal = super().agent_hello(hello)
        if refusal is None:
            self.hellos = {r: h for r, h in self.hellos.items() if self.get(r) is not None}
            self.hellos[hello.replica_id] = hello
            self.relay(frame(b"H", encode_hello(hello)))
        return refusal

    def agent_load(self, replica_id: str, load: AgentLoad) -> None:
        super().agent_load(replica_id, load)
        doc = [replica_id, load.running, load.waiting, load.kv_usage, load.prefix_queries, load.prefix_hits]
        self.relay(encode_json(b"N", doc))

    def agent_engine(self, replica_id: str, engine: AgentEngine) -> None:
        super().agent_engine(replica_id, engine)
        self.relay(engine_frame(replica_id, engine))

    def agent_state(self, replica_id: str, *, connected: bool, degraded: bool) -> None:
        super().agent_state(replica_id, connected=connected, degraded=degraded)
        self.relay(encode_json(b"A", [replica_id, connected, degraded]))

    def check_result(self, replica: str, ok: bool, error: str = "") -> None:
        super().check_result(replica, ok, error)
        self.relay(encode_json(b"C", [replica, ok, error]))


@dataclass(eq=False)
class _Conn:
    """One worker's connection (owned by its reader task)."""

    number: int
    out: FrameWriter
    sent_load: bytes = b""

    def send(self, data: bytes) -> None:
        self.out.send(data)


@dataclass(eq=False)
class _Gather:
    """A metrics gather: the workers asked, and their answers as they come."""

    expected: set[int]
    answers: dict[int, bytes] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class HubHooks:
    """What the hub asks of its owner: ``reload`` (None or the error), ``ready`` (worker number
    listening), ``held_prefix`` (to the replica's agent)."""

    reload: Callable[[], str | None]
    ready: Callable[[int], None]
    held_prefix: Callable[[str, Sequence[int], Sequence[int]], bool]
    registry: CollectorRegistry


class Hub:
    """The parent's fan-out to the workers; also the inventory server's observer."""

    def __init__(self, index: PrefixIndex, fleet: OwnerFleet, hooks: HubHooks) -> None:
        self._index = index
        self._fleet = fleet
        self._hooks = hooks
        self._conns: dict[int, _Conn] = {}
        self._server: asyncio.AbstractServer | None = None
        self._tasks = TaskSet()  # worker channels and metrics gathers
        self._gathers: dict[int, _Gather] = {}
        self._gather_ids = itertools.count(1)
        self._bound = frame_bound(index)
        self._load_timer: asyncio.TimerHandle | None = None
        self._fit_timer: asyncio.TimerHandle | None = None
        self._fitted: dict[str, None] = {}  # replicas fitted since their fit was last published
        self._loads = LoadTable()  # every worker's in-flight load (gateway/local_hub_load.py)
        self._touches = TouchBatcher(
            index, lambda r: fleet.get(r) is not None, self._relay_touches, TOUCH_WINDOW_S
        )
        fleet.relay = self.broadcast

    # ------------------------------------------------------------------ InventoryObserver
    def inventory_hello(self, hello: AgentHello) -> None:
        pass  # relayed by OwnerFleet.agent_hello, before the link state that follows it

    def inventory_snapshot(self, replica: str, entries: Mapping[int, str]) -> None:
        self.broadcast(encode_replica(b"S", replica, encode_snapshot(entries)))

    def inventory_ops(self, replica: str, ops: Sequence[Op]) -> None:
        self.broadcast(encode_replica(b"O", replica, encode_ops(ops)))

    # ------------------------------------------------------------------ fan-out
    def broadcast(self, data: bytes, but: int | None = None) -> None:
        for number, conn in self._conns.items():
            if number != but:
                conn.send(data)

    def state_frames(self) -> list[bytes]:
        """The whole state a (re)connecting worker starts from (built without awaiting)."""
        index, out = self._index, []
        for rec in self._fleet.records():
            rid = rec.id
            hello = self._fleet.hellos.get(rid)
            if hello is not None:
                out.append(frame(b"H", encode_hello(hello)))
            out.append(encode_json(b"A", [rid, rec.link.connected, rec.link.degraded]))
            adapters = rec.identity.adapters
            engine = AgentEngine(rec.identity.hybrid, adapters or frozenset(), adapters is not None)
            out.append(engine_frame(rid, engine))
            load = rec.engine_load
            out.append(encode_json(b"N", [rid, load.running, load.waiting, load.kv_usage, 0, 0]))
            if rec.health.checked:
                out.append(encode_json(b"C", [rid, rec.health.healthy, rec.health.last_error]))
            # the media as the index recorded them (the parent's index is the authority)
            out.append(encode_replica(b"S", rid, encode_snapshot(index.precise_entries(rid))))
            out.append(encode_stamps(rid, index.approximate_expiry(rid)))
            if self._fleet.ttft.model.params(rid).observations:
                out.append(fit_frame(self._fleet.ttft.model, rid))
        out.append(encode_json(b"R", self._loads.others(None)))
        out.append(frame(b"Y"))
        return out

    # ------------------------------------------------------------------ lifecycle
    async def start(self, path: str) -> None:
        warm_up()  # the first TTFT fit's one-time cost, before any worker is served
        self._server = await asyncio.start_unix_server(self._serve, path=path, limit=1 << 20)

    async def stop(self) -> None:
        for timer in (self._load_timer, self._fit_timer):
            if timer is not None:
                timer.cancel()
        self._load_timer = self._fit_timer = None
        self._touches.cancel()
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self._conns.values()):
            conn.out.abort()
        await self._tasks.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.adopt(task)
        conn: _Conn | None = None
        try:
            kind, payload = await read_frame(reader, self._bound)
            if kind != b"W":
                raise CodecError(f"expected a worker hello, got {kind!r}")
            number = int(decode_json(payload)[0])
            old = self._conns.get(number)
            if old is not None:
                old.out.abort()  # a restarted worker replaces its predecessor
                self._loads.drop(number)  # and its flights (its reports start afresh)
            # the state goes first, straight to the transport: the bound leaves room for it (its
            # size as built: a bound from configured maxima missed a replica's LoRA adapters)
            state = self.state_frames()
            bound = MAX_PENDING_BYTES + sum(map(len, state))
            conn = _Conn(number, FrameWriter(writer, bound, f"worker {number}"))
            writer.writelines(state)  # then, with no await between, the live ones
            self._conns[number] = conn
            while True:
                kind, payload = await read_frame(reader, self._bound)
                self._handle(conn, kind, payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except (CodecError, ValueError, TypeError, IndexError) as exc:
            log.error("worker channel: malformed frame, closing it: %s", exc)
        finally:
            if conn is not None and self._conns.get(conn.number) is conn:
                del self._conns[conn.number]
                self._loads.drop(conn.number)
                self._load_changed()  # its in-flight requests are gone with it
            writer.transport.abort()

    # ------------------------------------------------------------------ from the workers
    def _handle(self, conn: _Conn, kind: bytes, payload: bytes) -> None:
        if kind == b"T":
            replica, keys, lifetime = decode_touch(payload)
            if keys:  # applied here with others, then relayed (local_hub_touch.py)
                self._touches.add(Touch(replica, keys, lifetime, conn.number, frame(kind, payload)))
        elif kind == b"L":
            if self._conns.get(conn.number) is conn:  # not a replaced predecessor's last frame
                self._loads.update(conn.number, decode_json(payload))
                self._load_changed()
        elif kind == b"F":  # a first token: fitted here, the fit published (workers_ttft.py)
            replica, inputs, observed_ms = decode_observation(payload)
            model = self._fleet.ttft.model
            if self._fleet.get(replica) is not None and model.observe_first_token(
                replica, inputs, observed_ms
            ):
                self._fit_changed(replica)
        elif kind == b"P":
            replica, keys, tokens = decode_json(payload)
            self._hooks.held_prefix(str(replica), keys, tokens)
        elif kind == b"Q":
            if self._hooks.reload() is None:
                self.broadcast(frame(b"Q"), but=conn.number)
        elif kind == b"K":
            self._hooks.ready(conn.number)
        elif kind == b"X":
            tag, _ = decode_tagged(payload)
            self._spawn(self._gather(conn, tag))
        elif kind == b"g":
            gid, text = decode_tagged(payload)
            gather = self._gathers.get(gid)
            if gather is not None:
                gather.answers[conn.number] = text
                if gather.expected <= set(gather.answers):
                    gather.done.set()
        else:
            raise CodecError(f"unknown frame kind {kind!r}")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.start(coro, name="kvgate-metrics-gather")

    async def _gather(self, asker: _Conn, tag: int) -> None:
        """Every worker's exposition (and the parent's), merged with a ``worker`` label."""
        gid = next(self._gather_ids)
        gather = self._gathers[gid] = _Gather(set(self._conns))
        try:
            self.broadcast(encode_tagged(b"G", gid, b""))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gather.done.wait(), METRICS_WAIT_S)
        finally:
            del self._gathers[gid]
        answers = gather.answers
        texts = {str(n): answers[n] for n in sorted(answers)}
        texts["parent"] = generate_latest(self._hooks.registry)
        asker.send(encode_tagged(b"M", tag, merge_expositions(texts)))

    def _relay_touches(self, batch: list[Touch]) -> None:
        """A batch applied here goes to every worker but each touch's own, in this order."""
        for number, conn in self._conns.items():
            for touch in batch:
                if touch.origin != number:
                    conn.send(touch.frame)

    def _fit_changed(self, replica: str) -> None:
        """Publish ``replica``'s fit within ``FIT_PUBLISH_S`` (once, whatever it fits till then)."""
        self._fitted[replica] = None
        if self._fit_timer is None:
            self._fit_timer = asyncio.get_running_loop().call_later(FIT_PUBLISH_S, self._publish_fits)

    def _publish_fits(self) -> None:
        """Every worker gets the fits changed since the last publication, in the order first
        changed; a replica that left the fleet since is skipped (its fit went with it)."""
        self._fit_timer = None
        fitted, self._fitted = self._fitted, {}
        model = self._fleet.ttft.model
        for replica in fitted:
            if self._fleet.get(replica) is not None:
                self.broadcast(fit_frame(model, replica))

    def _load_changed(self) -> None:
        """Relay the workers' load once per ``LOAD_RELAY_S`` at most, however many report."""
        if self._load_timer is None:
            self._load_timer = asyncio.get_running_loop().call_later(LOAD_RELAY_S, self._send_load)

    def _send_load(self) -> None:
        """Each worker gets the other workers' in-flight load (when it changed)."""
        self._load_timer = None
        others = self._loads.others_each(conn.number for conn in self._conns.values())
        for conn in self._conns.values():
            data = encode_json(b"R", others[conn.number])
            if data != conn.sent_load:
                conn.sent_load = data
                conn.send(data)
