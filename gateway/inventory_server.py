"""The gateway's end of the agent stream (docs/architecture.md, the inventory path):
``Inventory.Sync`` over grpc.aio.

One stream per agent. The server checks the bearer token (which replica it may speak for:
gateway/agent_credentials.py) and hands each message, as it arrives, to
``gateway.inventory_stream.Streams`` (synchronous: the Hello goes to the fleet, snapshots and
deltas to the prefix index). Its only other coroutine per stream is the writer, which sends
Ack/Resync/HeldPrefix and never touches the index.

Invariants
* Index mutations never await: a message is applied by synchronous code between two
  ``await context.read()``.
* Every stream ends through one path (``_sync``'s epilogue): the writer is stopped first, letting
  a write in flight complete, and only then is the status sent. A status sent while a write is in
  flight is refused by gRPC core (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS) and the client never gets
  it; so a refusal is always delivered with its own status.
* A refusal (a Hello for a replica the stream's token does not speak for or at a URL the
  registration rules refuse, malformed message, unknown replica, block-size mismatch, a replica
  over its block bound, a newer stream for the replica) leaves the index and the fleet as they
  were: identity and URL are checked before the fleet hears of the Hello.
* A stream that closes leaves the replica's entries in the index: the engine still holds those
  blocks, and the next stream's snapshot replaces them. The fleet is told the stream is gone.
* The writer sends an ack no sooner than ``ack_interval_s`` after its previous write (the first
  at once): acks owed meanwhile coalesce into the newest. A resync, a hint or the stream's end
  does not wait. Why: an ack is a gRPC write on the event loop (and a wake-up of gRPC's poller
  thread), one per agent message before: ~8 % of the loop's busy time on a RAG replay at 17
  requests a second (docs/performance.md, "Acks paced"); the agent only reports the position.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import grpc.aio
from prometheus_client import CollectorRegistry

from gateway.agent_credentials import AgentCredentials, Identity, RegistrationRules, StreamAccess
from gateway.asyncio_tasks import cancel_and_wait
from gateway.inventory_metrics import InventoryMetrics
from gateway.inventory_ops import MAX_MESSAGE_BYTES
from gateway.inventory_refusals import Refusal
from gateway.inventory_sink import FleetSink
from gateway.inventory_stream import InventoryObserver, StreamRules, Streams, StreamState
from proto.contract import METHOD, SERVICE
from proto.kvgate.v1 import inventory_pb2 as pb
from router_policies.prefix_index import PrefixIndex

__all__ = ["InventoryServer"]

log = logging.getLogger(__name__)

# How long a stream's end waits for the write in flight (an ack: tiny) to complete. Only a client
# that stopped reading makes it wait this long; such a client will not read the status either.
WRITER_DRAIN_S = 5.0

_Context: TypeAlias = "grpc.aio.ServicerContext[bytes, pb.GatewayMessage]"


def _read_files(*paths: str) -> tuple[bytes, ...]:
    return tuple(Path(p).read_bytes() for p in paths)


@dataclass(frozen=True, slots=True)
class InventorySettings:
    """How the server runs its streams (``inventory.*`` in the config).

    ``block_bound_factor``, ``ack_every``: see ``StreamRules``; acks not yet written coalesce into
    the newest, so acking every message costs little under load.
    ``ack_interval_s``: the least time between an ack and the write before it (module docstring;
    0: acks go as soon as they are owed).
    ``tls_cert``/``tls_key``: PEM file paths to serve TLS instead of plaintext."""

    block_bound_factor: float = 4.0
    ack_every: int = 1
    ack_interval_s: float = 0.1
    tls_cert: str | None = None
    tls_key: str | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        if self.block_bound_factor < 0:
            raise ValueError("block_bound_factor must be >= 0")
        if self.ack_every <= 0:
            raise ValueError("ack_every must be positive")
        if not self.ack_interval_s >= 0:
            raise ValueError("ack_interval_s must be >= 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")


class InventoryServer:
    """``Inventory.Sync`` server over ``index``, reporting agents to ``fleet``.

    ``token``: the bearer token agents must present (None: no authentication).
    ``settings``: ``InventorySettings``.
    ``access``: per-replica credentials and registration rules (instead of ``token``, the one
    shared token; gateway/agent_credentials.py).
    """

    def __init__(
        self,
        index: PrefixIndex,
        fleet: FleetSink,
        *,
        token: str | None,
        registry: CollectorRegistry,
        settings: InventorySettings | None = None,
        access: StreamAccess | None = None,
    ) -> None:
        s = settings or InventorySettings()
        self.settings = s
        self.index = index
        self.fleet = fleet
        self.metrics = InventoryMetrics(registry)
        if access is None:
            access = StreamAccess(AgentCredentials.shared_only(token), RegistrationRules())
        elif token is not None:
            raise ValueError("token or access, not both")
        rules = StreamRules(s.block_bound_factor, s.ack_every, s.clock, *access)
        self._streams = Streams(index, fleet, self.metrics, rules)
        self._credentials = access.credentials
        self._tls = (s.tls_cert, s.tls_key) if s.tls_cert and s.tls_key else None
        self._max_message_bytes = s.max_message_bytes
        self._server: grpc.aio.Server | None = None

    @property
    def observer(self) -> InventoryObserver | None:
        """Told of every applied mutation (the app wires the shared-state publisher here)."""
        return self._streams.observer

    @observer.setter
    def observer(self, observer: InventoryObserver | None) -> None:
        self._streams.observer = observer

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
            cert, key = _read_files(cert_path, key_path)  # once, at start-up
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
        return sorted(self._streams.writers)

    def held_prefix(self, replica: str, keys: Sequence[int], next_tokens: Sequence[int]) -> bool:
        """A recovery hint for the replica's agent (``Streams.held_prefix``)."""
        return self._streams.held_prefix(replica, keys, next_tokens)

    def request_resync(self, replica: str, reason: str = "admin") -> bool:
        """Ask the replica's agent for a full snapshot; False when it has no open stream."""
        return self._streams.request_resync(replica, reason)

    def _handle(self, stream: StreamState, raw: bytes) -> None:
        """One message without gRPC (bench/ingest.py measures the ingest path with it); the
        stream has no bearer token, so it speaks for any replica only when auth is off."""
        if stream.identity is None:
            stream.identity = self._credentials.identify(b"")
        self._streams.handle(stream, raw)

    # ------------------------------------------------------------------ the stream
    async def _sync(self, _requests: Any, context: _Context) -> None:
        stream = StreamState(peer=context.peer(), task=asyncio.current_task())
        self.metrics.streams.inc()
        try:
            refusal = await self._serve(stream, context)
        finally:
            # the one way a stream ends: no write in flight from here on, then the status; the
            # fleet hears of the end even if stopping the writer is cancelled (a client that left)
            try:
                await self._stop_writer(stream)
            finally:
                self.metrics.streams.dec()
                self._streams.release(stream)
        if refusal is not None:
            await context.abort(refusal.code, refusal.message)

    async def _serve(self, stream: StreamState, context: _Context) -> Refusal | None:
        """Read and handle messages until the agent closes (None) or a refusal (returned)."""
        try:
            # the first message is read before the verdict, so that the client's first write has
            # completed when the stream closes and the client sees this status, not a failed write
            first = await context.read()
            stream.identity = self._check_auth(context)
            if first is grpc.aio.EOF:
                return None
            assert isinstance(first, bytes)
            self._streams.handle(stream, first)
            stream.writer = asyncio.create_task(self._write_loop(stream, context), name="inventory-writer")
            while True:
                try:
                    raw = await context.read()
                except asyncio.CancelledError:
                    if stream.superseded:
                        raise Refusal(
                            grpc.StatusCode.ABORTED,
                            "superseded",
                            f"superseded by a newer stream for replica {stream.replica!r}",
                        ) from None
                    raise
                if raw is grpc.aio.EOF:
                    return None
                assert isinstance(raw, bytes)
                self._streams.handle(stream, raw)
        except Refusal as refusal:
            self.metrics.refused.labels(refusal.reason).inc()
            log.warning(
                "inventory stream from %s (replica %s) refused: %s",
                stream.peer,
                stream.replica,
                refusal.message,
            )
            return refusal

    def _check_auth(self, context: _Context) -> Identity:
        """The identity the stream's bearer token proves; UNAUTHENTICATED without one."""
        presented = b""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                if text.startswith("Bearer "):
                    presented = text[len("Bearer ") :].encode()
                break
        identity = self._credentials.identify(presented)
        if identity is None:
            raise Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                "auth",
                "missing or wrong agent token (metadata 'authorization: Bearer <token>')",
            )
        return identity

    # ------------------------------------------------------------------ the writer
    async def _write_loop(self, stream: StreamState, context: _Context) -> None:
        loop = asyncio.get_running_loop()
        last = -math.inf  # loop time of the last write
        while True:
            await stream.wake.wait()
            stream.wake.clear()
            await _ack_pause(stream, last + self.settings.ack_interval_s)
            msg = _next_message(stream)
            while msg is not None and not stream.closing:
                await context.write(msg)
                last = loop.time()
                msg = _next_message(stream)
            if stream.closing:
                return

    async def _stop_writer(self, stream: StreamState) -> None:
        """End the stream's writer without interrupting a write: cancelling the task that awaits
        a write does not withdraw the write from gRPC core, and the status sent next would fail."""
        writer, stream.writer = stream.writer, None
        if writer is None:
            return
        stream.closing = True
        stream.wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(writer), WRITER_DRAIN_S)
        except TimeoutError:
            log.warning("inventory stream from %s: the agent stopped reading; closing anyway", stream.peer)
        except asyncio.CancelledError:
            writer.cancel()
            raise
        except Exception as exc:  # the write failed: the client is gone, nothing more to send
            log.debug("inventory stream from %s: last write failed: %s", stream.peer, exc)
        if not writer.done():
            await cancel_and_wait(writer)


async def _ack_pause(stream: StreamState, until: float) -> None:
    """Wait for loop time ``until`` while an ack is all the writer owes (module docstring): acks
    owed meanwhile replace it; a resync, a hint or the stream's end ends the wait."""
    loop = asyncio.get_running_loop()
    while stream.ack_seq is not None and stream.resync_reason is None and not stream.held:
        delay = until - loop.time()
        if delay <= 0 or stream.closing:
            return
        try:
            async with asyncio.timeout(delay):
                await stream.wake.wait()
        except TimeoutError:
            return
        stream.wake.clear()


def _next_message(stream: StreamState) -> pb.GatewayMessage | None:
    """The next message the writer owes the agent: a resync first, then the newest ack, then a
    recovery hint."""
    if stream.resync_reason is not None:
        reason, stream.resync_reason = stream.resync_reason, None
        return pb.GatewayMessage(resync=pb.Resync(reason=reason))
    if stream.ack_seq is not None:
        seq, stream.ack_seq = stream.ack_seq, None
        kbs = stream.key_block_size if seq == 1 else 0
        return pb.GatewayMessage(ack=pb.Ack(seq=seq, key_block_size=kbs))
    if stream.held:
        return pb.GatewayMessage(held=stream.held.popleft())
    return None
