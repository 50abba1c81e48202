"""The gateway's end of the agent stream (ARCHITECTURE.md §5): ``Inventory.Sync`` over grpc.aio.

One stream per agent. The server checks the bearer token, takes the agent's Hello to the fleet,
then applies the agent's snapshot and deltas to the prefix index.

Invariants
* One writer per replica: a newer stream for the same replica supersedes the older one, which is
  closed with ABORTED before the newer one is handed any message.
* Index mutations never await: each received message is applied by synchronous code between two
  ``await context.read()``; the only other coroutine of a stream is its writer, which only sends
  Ack/Resync and never touches the index.
* A message is applied whole or not at all. A malformed message, an unknown replica (the fleet
  refuses the Hello), a block-size mismatch or a replica over its block bound closes the stream
  with a clear status and leaves the index as it was. Snapshot chunks are staged aside and replace
  the replica's precise inventory atomically (``PrefixIndex.replace_replica``) on the last chunk.
* Deltas received before the stream's first complete snapshot are ignored: the agent always sends
  a snapshot right after its Hello, and deltas arriving while a snapshot is being staged are
  applied to the staged copy, so nothing is lost.
* A stream that closes leaves the replica's entries in the index: the engine still holds those
  blocks, and the next stream's snapshot replaces them. The fleet is told the stream is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import grpc.aio
from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry

from gateway.inventory_metrics import InventoryMetrics
from gateway.inventory_sink import AgentHello, AgentLoad, FleetSink
from proto.kvgate.v1 import inventory_pb2 as pb
from router_policies.prefix_index import GPU, IndexBoundError, PrefixIndex

__all__ = ["AgentHello", "AgentLoad", "FleetSink", "InventoryServer"]

log = logging.getLogger(__name__)

SERVICE = "kvgate.v1.Inventory"
METHOD = "Sync"
PROTOCOL_VERSION = 1


class InventoryObserver(Protocol):
    """Told of every mutation the server applied, after it applied it (gateway/shared_state.py
    publishes them). Called synchronously between two reads of a stream: must not block or await."""

    def inventory_hello(self, hello: AgentHello) -> None: ...

    def inventory_snapshot(self, replica: str, entries: Mapping[int, str]) -> None: ...

    def inventory_events(self, replica: str, events: Sequence[pb.Event]) -> None: ...


class _Refusal(Exception):
    """Close the stream with ``code``; ``reason`` is the metric label."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


@dataclass(slots=True)
class _Stream:
    """State of one agent stream; owned by the coroutine serving it."""

    peer: str
    task: asyncio.Task[Any] | None
    replica: str | None = None
    bound: int = 0
    expected_seq: int = 1
    synced: bool = False  # a complete snapshot has been applied
    agent_degraded: bool = False
    staging: dict[int, str] | None = None  # snapshot being received
    staging_id: int = 0
    superseded: bool = False
    unacked: int = 0
    # outbound slots drained by the stream's writer (bounded: at most one Ack and one Resync)
    ack_seq: int | None = None
    resync_reason: str | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    last_gaps: tuple[int, int] = (0, 0)
    key_block_size: int = 0  # the gateway's block size, sent on the Ack of the Hello (seq 1)

    @property
    def degraded(self) -> bool:
        return self.agent_degraded or not self.synced


class InventoryServer:
    """``Inventory.Sync`` server over ``index``, reporting agents to ``fleet``.

    ``token``: the bearer token agents must present (None: no authentication).
    ``block_bound_factor``: a replica may hold at most ``factor * capacity_blocks`` precise
    blocks (the capacity its Hello reports; never more than the index's
    ``max_blocks_per_replica``); 0 disables the capacity-derived bound.
    ``ack_every``: acknowledge after this many applied messages (and after every snapshot); acks
    not yet written coalesce into the newest, so acking every message costs little under load.
    ``tls_cert``/``tls_key``: PEM file paths to serve TLS instead of plaintext.
    """

    def __init__(
        self,
        index: PrefixIndex,
        fleet: FleetSink,
        *,
        token: str | None,
        registry: CollectorRegistry,
        block_bound_factor: float = 4.0,
        ack_every: int = 1,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if block_bound_factor < 0:
            raise ValueError("block_bound_factor must be >= 0")
        if ack_every <= 0:
            raise ValueError("ack_every must be positive")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        self.index = index
        self.fleet = fleet
        self.metrics = InventoryMetrics(registry)
        self._token = token.encode() if token else None
        self._factor = block_bound_factor
        self._ack_every = ack_every
        self._tls = (tls_cert, tls_key) if tls_cert and tls_key else None
        self._max_message_bytes = max_message_bytes
        self._clock = clock
        self._writers: dict[str, _Stream] = {}
        self._server: grpc.aio.Server | None = None
        self.observer: InventoryObserver | None = None  # SharedState sets itself here

    # ------------------------------------------------------------------ lifecycle
    async def start(self, host_port: str) -> int:
        """Listen on ``host_port`` (port 0 picks a free one); returns the bound port."""
        if self._server is not None:
            raise RuntimeError("inventory server already started")
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self._max_message_bytes),
                ("grpc.max_send_message_length", 1024 * 1024),
            ]
        )
        handler = grpc.stream_stream_rpc_method_handler(
            self._sync,
            # raw bytes in: a message that does not parse is refused with a clear status here,
            # rather than by grpc's generic deserialization failure
            request_deserializer=None,
            response_serializer=pb.GatewayMessage.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),))
        if self._tls is not None:
            cert_path, key_path = self._tls
            with open(cert_path, "rb") as f:
                cert = f.read()
            with open(key_path, "rb") as f:
                key = f.read()
            port = int(server.add_secure_port(host_port, grpc.ssl_server_credentials([(key, cert)])))
        else:
            port = int(server.add_insecure_port(host_port))
        if port == 0:
            raise OSError(f"inventory server cannot listen on {host_port}")
        await server.start()
        self._server = server
        return port

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting streams, close the open ones (after ``grace`` seconds at most)."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)

    # ------------------------------------------------------------------ queries
    def connected_replicas(self) -> list[str]:
        return sorted(self._writers)

    def request_resync(self, replica: str, reason: str = "admin") -> bool:
        """Ask the replica's agent for a full snapshot; False when it has no open stream."""
        stream = self._writers.get(replica)
        if stream is None:
            return False
        self._ask_resync(stream, reason)
        return True

    # ------------------------------------------------------------------ the stream
    async def _sync(
        self, _requests: Any, context: grpc.aio.ServicerContext[bytes, pb.GatewayMessage]
    ) -> None:
        stream = _Stream(peer=context.peer(), task=asyncio.current_task())
        self.metrics.streams.inc()
        writer: asyncio.Task[None] | None = None
        try:
            # the first message is read before the verdict, so that the client's first write has
            # completed when the stream closes and the client sees this status, not a failed write
            first = await context.read()
            self._check_auth(context)
            if first is grpc.aio.EOF:
                return
            assert isinstance(first, bytes)
            self._handle(stream, first)
            writer = asyncio.create_task(self._write_loop(stream, context), name="inventory-writer")
            while True:
                try:
                    raw = await context.read()
                except asyncio.CancelledError:
                    if stream.superseded:
                        raise _Refusal(
                            grpc.StatusCode.ABORTED,
                            "superseded",
                            f"superseded by a newer stream for replica {stream.replica!r}",
                        ) from None
                    raise
                if raw is grpc.aio.EOF:
                    return
                assert isinstance(raw, bytes)
                self._handle(stream, raw)
        except _Refusal as refusal:
            self.metrics.refused.labels(refusal.reason).inc()
            log.warning(
                "inventory stream from %s (replica %s) refused: %s",
                stream.peer,
                stream.replica,
                refusal.message,
            )
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
                writer = None
            await context.abort(refusal.code, refusal.message)
        finally:
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
            self.metrics.streams.dec()
            self._release(stream)

    def _check_auth(self, context: grpc.aio.ServicerContext[bytes, pb.GatewayMessage]) -> None:
        if self._token is None:
            return
        presented = b""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                if text.startswith("Bearer "):
                    presented = text[len("Bearer ") :].encode()
                break
        if not hmac.compare_digest(presented, self._token):
            raise _Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                "auth",
                "missing or wrong agent token (metadata 'authorization: Bearer <token>')",
            )

    async def _write_loop(
        self, stream: _Stream, context: grpc.aio.ServicerContext[bytes, pb.GatewayMessage]
    ) -> None:
        while True:
            await stream.wake.wait()
            stream.wake.clear()
            if stream.resync_reason is not None:
                reason, stream.resync_reason = stream.resync_reason, None
                await context.write(pb.GatewayMessage(resync=pb.Resync(reason=reason)))
            if stream.ack_seq is not None:
                seq, stream.ack_seq = stream.ack_seq, None
                kbs = stream.key_block_size if seq == 1 else 0
                await context.write(pb.GatewayMessage(ack=pb.Ack(seq=seq, key_block_size=kbs)))

    def _release(self, stream: _Stream) -> None:
        replica = stream.replica
        if replica is None or self._writers.get(replica) is not stream:
            return
        del self._writers[replica]
        self.fleet.agent_state(replica, connected=False, degraded=stream.degraded)

    # ------------------------------------------------------------------ message handling (sync)
    def _handle(self, stream: _Stream, raw: bytes) -> None:
        try:
            msg = pb.AgentMessage.FromString(raw)
        except DecodeError as exc:
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT, "malformed", f"malformed AgentMessage: {exc}"
            ) from None
        kind = msg.WhichOneof("body")
        if kind is None:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "AgentMessage without a body")
        if stream.replica is None:
            if kind != "hello":
                raise _Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "protocol",
                    f"the first message must be hello, got {kind}",
                )
            self._hello(stream, msg)
            return
        if msg.seq != stream.expected_seq:
            # gRPC streams do not lose messages; a jump is an agent bug. Start over from a snapshot.
            self.metrics.gaps.labels("stream").inc()
            self._ask_resync(stream, f"stream seq {msg.seq}, expected {stream.expected_seq}")
        stream.expected_seq = msg.seq + 1
        if kind == "events":
            self._events(stream, msg.events)
        elif kind == "snapshot":
            self._snapshot(stream, msg.snapshot)
        elif kind == "load":
            ld = msg.load
            assert stream.replica is not None
            self.fleet.agent_load(
                stream.replica,
                AgentLoad(
                    running=ld.running,
                    waiting=ld.waiting,
                    kv_usage=ld.kv_usage,
                    prefix_queries=ld.prefix_queries,
                    prefix_hits=ld.prefix_hits,
                ),
            )
        elif kind == "state":
            self._state(stream, msg.state)
        else:  # a second hello
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "protocol", "hello sent twice on one stream")
        stream.unacked += 1
        if stream.unacked >= self._ack_every:
            self._ack(stream, msg.seq)

    def _hello(self, stream: _Stream, msg: pb.AgentMessage) -> None:
        h = msg.hello
        if msg.seq != 1:
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT, "protocol", f"hello must have seq 1, got {msg.seq}"
            )
        if not h.replica_id:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "hello.replica_id is empty")
        if h.block_size <= 0:
            raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "hello.block_size must be positive")
        if h.protocol_version not in (0, PROTOCOL_VERSION):
            raise _Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "protocol",
                f"agent speaks protocol {h.protocol_version}, gateway {PROTOCOL_VERSION}",
            )
        hello = AgentHello(
            replica_id=h.replica_id,
            url=h.url,
            models=tuple(h.models),
            block_size=h.block_size,
            capacity_blocks=h.capacity_blocks,
            engine=h.engine,
            engine_version=h.engine_version,
            agent_version=h.agent_version,
        )
        refusal = self.fleet.agent_hello(hello)
        if refusal is not None:
            raise _Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "hello_refused",
                f"replica {h.replica_id!r} refused: {refusal}",
            )
        try:
            self.index.add_replica(h.replica_id)
        except IndexBoundError as exc:
            raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "block_bound", str(exc)) from None
        bound = self.index.config.max_blocks_per_replica
        if self._factor > 0 and h.capacity_blocks > 0:
            bound = min(bound, max(1, int(self._factor * h.capacity_blocks)))
        stream.bound = bound
        stream.replica = h.replica_id
        stream.expected_seq = 2
        old = self._writers.get(h.replica_id)
        if old is not None:
            # one writer per replica: the old stream stops at its next await, before this one
            # is handed its next message, so the two never interleave mutations
            old.superseded = True
            self._writers.pop(h.replica_id)
            if old.task is not None:
                old.task.cancel()
        self._writers[h.replica_id] = stream
        self.fleet.agent_state(h.replica_id, connected=True, degraded=True)
        if self.observer is not None:
            self.observer.inventory_hello(hello)
        self.metrics.degraded.labels(h.replica_id).set(1)
        # acknowledging the hello tells the agent it was accepted before it sends its snapshot, and
        # at which block size the gateway keys (an agent keying a smaller engine page re-keys)
        key_block_size = getattr(self.fleet, "key_block_size", None)
        stream.key_block_size = key_block_size(hello.models) if callable(key_block_size) else 0
        self._ack(stream, 1)

    def _state(self, stream: _Stream, st: pb.AgentState) -> None:
        before = stream.degraded
        stream.agent_degraded = st.degraded
        gaps, unrecovered = st.engine_gaps, st.unrecovered_gaps
        last_gaps, last_unrecovered = stream.last_gaps
        if gaps >= last_gaps and unrecovered >= last_unrecovered:
            recovered_delta = (gaps - unrecovered) - (last_gaps - last_unrecovered)
            if recovered_delta > 0:
                self.metrics.gaps.labels("engine_recovered").inc(recovered_delta)
            if unrecovered > last_unrecovered:
                self.metrics.gaps.labels("engine_unrecovered").inc(unrecovered - last_unrecovered)
        stream.last_gaps = (gaps, unrecovered)
        if stream.degraded != before:
            self._report_state(stream)

    def _report_state(self, stream: _Stream) -> None:
        assert stream.replica is not None
        self.fleet.agent_state(stream.replica, connected=True, degraded=stream.degraded)
        self.metrics.degraded.labels(stream.replica).set(1 if stream.degraded else 0)

    def _ask_resync(self, stream: _Stream, reason: str) -> None:
        self.metrics.resyncs.labels("stream_gap" if reason.startswith("stream seq") else reason).inc()
        stream.synced = False
        stream.staging = None
        stream.resync_reason = reason
        stream.wake.set()

    def _ack(self, stream: _Stream, seq: int) -> None:
        stream.unacked = 0
        stream.ack_seq = seq
        stream.wake.set()

    # ------------------------------------------------------------------ snapshot
    def _snapshot(self, stream: _Stream, chunk: pb.SnapshotChunk) -> None:
        if stream.staging is None or stream.staging_id != chunk.snapshot_id:
            stream.staging = {}
            stream.staging_id = chunk.snapshot_id
        staging = stream.staging
        medium = chunk.medium or GPU
        for k in chunk.keys:
            staging[k] = medium
        if len(staging) > stream.bound:
            stream.staging = None
            raise _Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "block_bound",
                f"snapshot of replica {stream.replica!r} exceeds its bound of {stream.bound} blocks",
            )
        if not chunk.last:
            return
        stream.staging = None
        assert stream.replica is not None
        try:
            self.index.replace_replica(stream.replica, staging)
        except IndexBoundError as exc:
            raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "block_bound", str(exc)) from None
        if self.observer is not None:
            self.observer.inventory_snapshot(stream.replica, staging)
        self.metrics.snapshots_applied.inc()
        was_degraded = stream.degraded
        stream.synced = True
        if stream.degraded != was_degraded:
            self._report_state(stream)
        self._ack(stream, stream.expected_seq - 1)

    # ------------------------------------------------------------------ deltas
    def _events(self, stream: _Stream, batch: pb.Events) -> None:
        events = batch.events
        if stream.staging is not None:
            self._events_into(stream, stream.staging, events)
            return
        if not stream.synced:
            return
        replica = stream.replica
        assert replica is not None
        index = self.index
        n_stored = 0
        for ev in events:
            if ev.WhichOneof("kind") == "stored":
                n_stored += len(ev.stored.keys)
        held = index.precise_count(replica)
        if held + n_stored > stream.bound or index.entries + n_stored > index.config.max_total_blocks:
            # near a bound: check the whole batch before applying any of it
            self._check_batch_bound(stream, events)
        stored = removed = cleared = 0
        try:
            for ev in events:
                which = ev.WhichOneof("kind")
                if which == "stored":
                    s = ev.stored
                    index.store(replica, s.keys, s.medium or GPU)
                    stored += len(s.keys)
                elif which == "removed":
                    removed += index.remove(replica, ev.removed.keys)
                elif which == "cleared":
                    index.clear_replica(replica)
                    cleared += 1
                else:
                    raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "Event without a kind")
        except IndexBoundError as exc:  # only the global bound can get here (see _check_batch_bound)
            raise _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "block_bound", str(exc)) from None
        finally:
            if stored:
                self.metrics.stored.inc(stored)
            if removed:
                self.metrics.removed.inc(removed)
            if cleared:
                self.metrics.cleared.inc(cleared)
        if self.observer is not None:
            self.observer.inventory_events(replica, events)
        if batch.engine_ts > 0:
            self.metrics.lag.observe(max(0.0, self._clock() - batch.engine_ts))

    def _check_batch_bound(self, stream: _Stream, events: Iterable[pb.Event]) -> None:
        """Replay the batch on a count of the replica's blocks; refuse it if any step exceeds the
        replica's bound or the index's total (counted conservatively), so nothing is applied."""
        replica = stream.replica
        assert replica is not None
        held = set(self.index.precise_keys(replica))
        count = len(held)
        base_total = self.index.entries - count
        limit_total = self.index.config.max_total_blocks
        for ev in events:
            which = ev.WhichOneof("kind")
            if which == "stored":
                for k in ev.stored.keys:
                    if k not in held:
                        held.add(k)
                        count += 1
                if count > stream.bound or base_total + count > limit_total:
                    raise _Refusal(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "block_bound",
                        f"replica {replica!r} would hold {count} blocks, over its bound of {stream.bound}"
                        if count > stream.bound
                        else f"index would exceed max_total_blocks={limit_total}",
                    )
            elif which == "removed":
                for k in ev.removed.keys:
                    if k in held:
                        held.discard(k)
                        count -= 1
            elif which == "cleared":
                held.clear()
                count = 0
            else:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "Event without a kind")

    def _events_into(self, stream: _Stream, staging: dict[int, str], events: Iterable[pb.Event]) -> None:
        for ev in events:
            which = ev.WhichOneof("kind")
            if which == "stored":
                medium = ev.stored.medium or GPU
                for k in ev.stored.keys:
                    staging.setdefault(k, medium)
            elif which == "removed":
                for k in ev.removed.keys:
                    staging.pop(k, None)
            elif which == "cleared":
                staging.clear()
            else:
                raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, "malformed", "Event without a kind")
        if len(staging) > stream.bound:
            stream.staging = None
            raise _Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "block_bound",
                f"replica {stream.replica!r} exceeds its bound of {stream.bound} blocks",
            )
