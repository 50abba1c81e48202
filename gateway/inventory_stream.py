"""What one agent message does (docs/architecture.md, the inventory path): synchronous handling of
``Inventory.Sync`` messages, between two reads of a stream (gateway/inventory_server.py owns the
gRPC side).

Path of a message: bytes -> ``AgentMessage`` -> (Hello: the fleet accepts the replica) or ops
(``gateway.inventory_ops``) -> ``apply_ops`` on the index, or on the snapshot being staged ->
the observer (shared-state publisher) is told what was applied.

Invariants
* One writer per replica: ``Streams.writers`` holds the one stream that may write a replica; a
  newer stream for the same replica supersedes the older one (its task is cancelled and it ends
  with ABORTED before the newer one is handed another message).
* Index mutations never await: everything here is synchronous.
* A message is applied whole or not at all: decoding and bound checks come before the first
  mutation, and a refusal (``Refusal``) leaves the index as it was.
* The replica set belongs to the fleet: a Hello is taken to ``FleetSink.agent_hello``, which
  registers the replica (with the index) or refuses it; this module never adds a replica.
* Deltas before the stream's first complete snapshot are ignored (the agent sends a snapshot right
  after its Hello); deltas arriving while a snapshot is staged apply to the staged copy.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from gateway.agent_credentials import AgentCredentials, Identity, RegistrationRules
from gateway.inventory_metrics import InventoryMetrics
from gateway.inventory_ops import (
    BoundCheck,
    BoundExceeded,
    IndexReplica,
    MalformedOps,
    Op,
    Staging,
    apply_ops,
    op_of_chunk,
    ops_of_events,
    stored_keys,
)
from gateway.inventory_refusals import Refusal, check_keyed_at, engine_of, malformed, over_bound, protocol
from gateway.inventory_sink import AgentHello, AgentLoad, FleetSink
from proto.contract import PROTOCOL_VERSION
from proto.kvgate.v1 import inventory_pb2 as pb
from router_policies.placement import replace_snapshot
from router_policies.prefix_index import IndexBoundError, PrefixIndex

MAX_HELD_HINTS = 64  # held-prefix hints queued per stream


class InventoryObserver(Protocol):
    """Told of every mutation applied, after it was applied (the shared-state publisher). Called
    synchronously between two reads of a stream: must not block or await."""

    def inventory_hello(self, hello: AgentHello) -> None: ...

    def inventory_snapshot(self, replica: str, entries: Mapping[int, str]) -> None: ...

    def inventory_ops(self, replica: str, ops: Sequence[Op]) -> None: ...


@dataclass(slots=True)
class StreamState:
    """State of one agent stream; owned by the coroutine serving it."""

    peer: str
    task: asyncio.Task[Any] | None
    replica: str | None = None
    bound: int = 0
    expected_seq: int = 1
    synced: bool = False  # a complete snapshot has been applied
    agent_degraded: bool = False
    staging: Staging | None = None  # snapshot being received
    superseded: bool = False
    unacked: int = 0
    # outbound slots drained by the stream's writer (bounded: at most one Ack and one Resync)
    ack_seq: int | None = None
    resync_reason: str | None = None
    writer: asyncio.Task[None] | None = None  # sends ack_seq / resync_reason
    closing: bool = False  # the writer stops before its next write
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    last_gaps: tuple[int, int] = (0, 0)
    key_block_size: int = 0  # the gateway's block size, sent on the Ack of the Hello (seq 1)
    keyed_at: int = 0  # the block size the agent's Hello says its keys cover
    # held-prefix hints for a degraded agent (docs/agent.md, "Recovery without replay"); bounded:
    # the oldest go, later requests send more
    held: deque[pb.HeldPrefix] = field(default_factory=lambda: deque(maxlen=MAX_HELD_HINTS))
    identity: Identity | None = None  # what the stream's token may speak for (set by the server)

    @property
    def degraded(self) -> bool:
        return self.agent_degraded or not self.synced


@dataclass(frozen=True, slots=True)
class StreamRules:
    """``block_bound_factor``: a replica may hold at most ``factor * capacity_blocks`` precise
    blocks (never more than the index's ``max_blocks_per_replica``; 0: no capacity bound).
    ``ack_every``: acknowledge after this many applied messages (and after every snapshot).
    ``credentials``: which token speaks for which replica; ``registration``: the URLs a Hello may
    (re)register a replica at (gateway/agent_credentials.py)."""

    block_bound_factor: float = 4.0
    ack_every: int = 1
    clock: Callable[[], float] = time.time
    credentials: AgentCredentials = field(default_factory=AgentCredentials)
    registration: RegistrationRules = field(default_factory=RegistrationRules)


class Streams:
    """The open agent streams and what their messages do to the index and the fleet."""

    def __init__(
        self, index: PrefixIndex, fleet: FleetSink, metrics: InventoryMetrics, rules: StreamRules
    ) -> None:
        self.index = index
        self.fleet = fleet
        self.metrics = metrics
        self.rules = rules
        self.writers: dict[str, StreamState] = {}
        self.observer: InventoryObserver | None = None

    def held_prefix(self, replica: str, keys: Sequence[int], next_tokens: Sequence[int]) -> bool:
        """Tell a degraded replica's agent that its engine holds ``keys`` and stored a block of
        ``next_tokens`` below them (False: no stream, or its inventory is not degraded)."""
        stream = self.writers.get(replica)
        if stream is None or not stream.agent_degraded:
            return False
        stream.held.append(pb.HeldPrefix(keys=keys, next_tokens=next_tokens))
        stream.wake.set()
        return True

    def request_resync(self, replica: str, reason: str) -> bool:
        stream = self.writers.get(replica)
        if stream is None:
            return False
        self._ask_resync(stream, reason)
        return True

    def release(self, stream: StreamState) -> None:
        """The stream ended: the fleet hears of it unless a newer stream took the replica over."""
        replica = stream.replica
        if replica is None or self.writers.get(replica) is not stream:
            return
        del self.writers[replica]
        self.fleet.agent_state(replica, connected=False, degraded=stream.degraded)

    # ------------------------------------------------------------------ one message
    def handle(self, stream: StreamState, raw: bytes) -> None:
        try:
            msg = pb.AgentMessage.FromString(raw)
        except DecodeError as exc:
            raise malformed(f"malformed AgentMessage: {exc}") from None
        kind = msg.WhichOneof("body")
        if kind is None:
            raise malformed("AgentMessage without a body")
        if stream.replica is None:
            if kind != "hello":
                raise protocol(f"the first message must be hello, got {kind}")
            self._hello(stream, msg)
            return
        if msg.seq != stream.expected_seq:
            # gRPC streams do not lose messages; a jump is an agent bug. Start over from a snapshot.
            self.metrics.gaps.labels("stream").inc()
            self._ask_resync(stream, f"stream seq {msg.seq}, expected {stream.expected_seq}")
        stream.expected_seq = msg.seq + 1
        if kind in ("events", "snapshot"):
            check_keyed_at(stream)
        if kind == "events":
            self._events(stream, msg.events)
        elif kind == "snapshot":
            self._snapshot(stream, msg.snapshot)
        elif kind == "load":
            ld = msg.load
            if not 0.0 <= ld.kv_usage <= 1.0:  # NaN too: the operator view's JSON could not hold it
                raise protocol(f"load kv_usage {ld.kv_usage} is not in [0, 1]")
            self.fleet.agent_load(
                stream.replica,
                AgentLoad(ld.running, ld.waiting, ld.kv_usage, ld.prefix_queries, ld.prefix_hits),
            )
        elif kind == "state":
            self._state(stream, msg.state)
        elif kind == "engine":  # hybrid flag and LoRA adapters (Fleet.agent_engine)
            self.fleet.agent_engine(stream.replica, engine_of(msg.engine))
        else:  # a second hello
            raise protocol("hello sent twice on one stream")
        stream.unacked += 1
        if stream.unacked >= self.rules.ack_every:
            self._ack(stream, msg.seq)

    def _hello(self, stream: StreamState, msg: pb.AgentMessage) -> None:
        h = msg.hello
        if msg.seq != 1:
            raise protocol(f"hello must have seq 1, got {msg.seq}")
        if not h.replica_id:
            raise malformed("hello.replica_id is empty")
        if h.block_size <= 0:
            raise malformed("hello.block_size must be positive")
        if h.protocol_version not in (0, PROTOCOL_VERSION):
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "protocol",
                f"agent speaks protocol {h.protocol_version}, gateway {PROTOCOL_VERSION}",
            )
        self._check_identity(stream, h.replica_id, h.url)
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
        # the fleet owns the replica set: it registers the replica with the index, or refuses
        refusal = self.fleet.agent_hello(hello)
        if refusal is not None:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                "hello_refused",
                f"replica {h.replica_id!r} refused: {refusal}",
            )
        bound = self.index.config.max_blocks_per_replica
        factor = self.rules.block_bound_factor
        if factor > 0 and h.capacity_blocks > 0:
            bound = min(bound, max(1, int(factor * h.capacity_blocks)))
        stream.bound = bound
        stream.replica = h.replica_id
        stream.expected_seq = 2
        old = self.writers.pop(h.replica_id, None)
        if old is not None:
            # one writer per replica: the old stream stops at its next await, before this one
            # is handed its next message, so the two never interleave mutations
            old.superseded = True
            if old.task is not None:
                old.task.cancel()
        self.writers[h.replica_id] = stream
        self.fleet.agent_state(h.replica_id, connected=True, degraded=True)
        if self.observer is not None:
            self.observer.inventory_hello(hello)
        self.metrics.degraded.labels(h.replica_id).set(1)
        # acknowledging the hello tells the agent it was accepted before it sends its snapshot, and
        # at which block size the gateway keys (an agent keying a smaller engine page re-keys)
        stream.key_block_size = self.fleet.key_block_size(hello.models)
        stream.keyed_at = h.block_size
        self._ack(stream, 1)

    def _check_identity(self, stream: StreamState, replica: str, url: str) -> None:
        """Before the fleet hears of the Hello: the stream's token speaks for ``replica``, and
        the URL is one a replica may be registered at. Refused with PERMISSION_DENIED."""
        rules = self.rules
        identity = stream.identity
        if identity is None or not rules.credentials.may_speak_for(identity, replica):
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                "identity",
                f"this stream's agent token may not speak for replica {replica!r}",
            )
        why = rules.registration.refusal(replica, url)
        if why is not None:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, "registration", f"replica {replica!r}: {why}")

    def _state(self, stream: StreamState, st: pb.AgentState) -> None:
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

    def _report_state(self, stream: StreamState) -> None:
        assert stream.replica is not None
        self.fleet.agent_state(stream.replica, connected=True, degraded=stream.degraded)
        self.metrics.degraded.labels(stream.replica).set(1 if stream.degraded else 0)

    def _ask_resync(self, stream: StreamState, reason: str) -> None:
        self.metrics.resyncs.labels("stream_gap" if reason.startswith("stream seq") else reason).inc()
        stream.synced = False
        stream.staging = None
        stream.resync_reason = reason
        stream.wake.set()

    def _ack(self, stream: StreamState, seq: int) -> None:
        stream.unacked = 0
        stream.ack_seq = seq
        stream.wake.set()

    # ------------------------------------------------------------------ snapshot
    def _snapshot(self, stream: StreamState, chunk: pb.SnapshotChunk) -> None:
        replica = stream.replica
        assert replica is not None
        staging = stream.staging
        if staging is None or staging.snapshot_id != chunk.snapshot_id:
            staging = stream.staging = Staging(chunk.snapshot_id, stream.bound)
        try:
            staging.add_chunk(op_of_chunk(chunk))
        except BoundExceeded as exc:
            stream.staging = None
            raise over_bound(f"snapshot of replica {replica!r} {exc}") from None
        if not chunk.last:
            return
        stream.staging = None
        try:
            replace_snapshot(self.index, replica, staging.entries, self.fleet.snapshot_keep())
        except IndexBoundError as exc:
            raise over_bound(str(exc)) from None
        if self.observer is not None:
            self.observer.inventory_snapshot(replica, staging.entries)
        self.metrics.snapshots_applied.inc()
        was_degraded = stream.degraded
        stream.synced = True
        if stream.degraded != was_degraded:
            self._report_state(stream)
        self._ack(stream, stream.expected_seq - 1)

    # ------------------------------------------------------------------ deltas
    def _events(self, stream: StreamState, batch: pb.Events) -> None:
        replica = stream.replica
        assert replica is not None
        try:
            ops = ops_of_events(batch.events)
            if stream.staging is not None:
                apply_ops(ops, stream.staging)
                stream.staging.check()
                return
            if not stream.synced:
                return
            index = self.index
            grow = stored_keys(ops)
            if index.precise_count(replica) + grow > stream.bound or (
                index.entries + grow > index.config.max_total_blocks
            ):
                # near a bound: replay the batch on a count first, so that none of it applies
                apply_ops(ops, BoundCheck.of(index, replica, stream.bound))
        except MalformedOps as exc:
            raise malformed(str(exc)) from None
        except BoundExceeded as exc:
            stream.staging = None
            raise over_bound(f"replica {replica!r} {exc}") from None
        self._apply(replica, ops)
        if self.observer is not None:
            self.observer.inventory_ops(replica, ops)
        if batch.engine_ts > 0:
            self.metrics.lag.observe(max(0.0, self.rules.clock() - batch.engine_ts))

    def _apply(self, replica: str, ops: Sequence[Op]) -> None:
        target = IndexReplica(self.index, replica)
        try:
            apply_ops(ops, target)
        except IndexBoundError as exc:  # only the global bound can get here (see BoundCheck)
            raise over_bound(str(exc)) from None
        finally:
            if target.stored:
                self.metrics.stored.inc(target.stored)
            if target.removed:
                self.metrics.removed.inc(target.removed)
            if target.cleared:
                self.metrics.cleared.inc(target.cleared)
