"""The agent's end of ``Inventory.Sync``: one stream at a time, reconnecting with jittered backoff.

Each stream sends Hello, then a full snapshot of the agent's inventory, then deltas from the outbox
in batches, the latest engine load, and the agent's state when it changes. On Resync it sends a
fresh snapshot. When the stream fails (gateway down, restarted, refused) the agent keeps
following its engine; the next stream begins with a snapshot, so the gateway catches up.

Shutdown order (``run`` cancelled): the stream's reader task is cancelled, the call is cancelled,
the channel closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import grpc
import grpc.aio
from google.protobuf.message import Message

from proto.contract import GPU, PROTOCOL_VERSION, wire_medium
from proto.kvgate.v1 import inventory_pb2 as pb
from proto.kvgate.v1 import inventory_pb2_grpc as pbg
from replica_agent.inventory import AgentInventory
from replica_agent.outbox import Outbox

log = logging.getLogger(__name__)
_CREDENTIAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

AGENT_VERSION = "0.1.0"
SNAPSHOT_CHUNK = 16_384  # keys per SnapshotChunk (8 bytes each: ~128 KiB)


@dataclass(slots=True)
class HelloInfo:
    """The agent's fields of the Hello message (same names; the client adds its versions)."""

    replica_id: str
    url: str
    models: list[str]
    block_size: int
    capacity_blocks: int
    engine: str
    engine_version: str


@dataclass(slots=True)
class ClientStats:
    """The stream's counts since start (agent_metrics exports them) and where it stands."""

    connects: int = 0
    failures: int = 0
    snapshots_sent: int = 0
    resyncs_received: int = 0
    messages_sent: int = 0
    last_error: str = ""  # the last connection failure, for the agent's status
    acked_seq: int = 0  # the gateway's latest acknowledgement (a position, not a count)


@dataclass(frozen=True, slots=True)
class Link:
    """How the client reaches the gateway: address, credentials, reconnect and batching pace."""

    target: str  # HOST:PORT
    token: str | None = None  # bearer token (None: none sent)
    tls_ca: bytes | None = None  # PEM roots to verify the gateway (None: plaintext)
    seed: int = 0  # of the reconnect jitter
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    flush_interval_s: float = 0.005  # wait after a wake-up so that a batch gathers


@dataclass(frozen=True, slots=True)
class Sources:
    """What the client streams (the agent's inventory, outbox and figures) and whom it tells
    of the gateway's block size."""

    inventory: AgentInventory
    outbox: Outbox
    hello: Callable[[], HelloInfo | None]
    state: Callable[[], pb.AgentState] | None = None
    load: Callable[[], pb.Load | None] | None = None
    engine: Callable[[], pb.EngineState] | None = None  # hybrid flag, LoRA adapters (sent on change)
    # the gateway's block size from the hello's Ack; True: the agent re-keys, say hello again
    on_key_block_size: Callable[[int], bool] | None = None


class GatewayClient:
    def __init__(self, link: Link, sources: Sources) -> None:
        self.link = link  # replaced whole (tests point a client elsewhere)
        self.src = sources
        self.inventory = sources.inventory
        self.outbox = sources.outbox
        self._rng = random.Random(link.seed)
        self.stats = ClientStats()
        self.connected = asyncio.Event()
        self._snapshot_id = 0
        self._last_sent: dict[str, bytes] = {}  # body -> last state / load / engine sent on this stream

    def backoff(self, attempt: int) -> float:
        """Delay before reconnect attempt ``attempt`` (0-based): exponential, capped, with jitter in
        [50%, 100%] from the seeded generator so that agents restarted together spread out."""
        base = min(self.link.backoff_max_s, self.link.backoff_initial_s * float(1 << min(attempt, 30)))
        return base * (0.5 + 0.5 * self._rng.random())

    async def run(self) -> None:
        attempt = 0
        while True:
            hello = self.src.hello()
            if hello is None:  # block size not known yet: wait for the engine to tell
                await asyncio.sleep(0.05)
                continue
            established = False
            try:
                established = await self._session(hello)
            except grpc.aio.AioRpcError as exc:
                self.stats.failures += 1
                self.stats.last_error = f"{exc.code().name}: {exc.details()}"
                if exc.code() in _CREDENTIAL_CODES:  # retrying will not help until someone acts
                    log.error(
                        "gateway %s refused this agent's credentials: %s (check --token-env and the "
                        "gateway's auth.agent_tokens / auth.registration)",
                        self.link.target,
                        self.stats.last_error,
                    )
                else:
                    log.warning("gateway stream to %s ended: %s", self.link.target, self.stats.last_error)
            except Exception as exc:  # e.g. a write after the RPC finished: reconnect all the same
                self.stats.failures += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("gateway stream to %s failed: %s", self.link.target, self.stats.last_error)
            finally:
                self.outbox.close()
                self.connected.clear()
            if established:
                attempt = 0
            await asyncio.sleep(self.backoff(attempt))
            attempt += 1

    def _channel(self) -> grpc.aio.Channel:
        options = [("grpc.max_send_message_length", 16 * 1024 * 1024)]
        if self.link.tls_ca is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=self.link.tls_ca)
            return grpc.aio.secure_channel(self.link.target, creds, options=options)
        return grpc.aio.insecure_channel(self.link.target, options=options)

    async def _session(self, hello: HelloInfo) -> bool:
        """One stream, until it fails. Returns whether the gateway accepted the Hello."""
        metadata = (("authorization", f"Bearer {self.link.token}"),) if self.link.token else None
        async with self._channel() as channel:
            stub = pbg.InventoryStub(channel)
            call = stub.Sync(metadata=metadata)
            seq = 0

            async def send(**body: object) -> None:
                nonlocal seq
                seq += 1
                await call.write(pb.AgentMessage(seq=seq, **body))  # type: ignore[arg-type]
                self.stats.messages_sent += 1

            reader: asyncio.Task[None] | None = None
            try:
                await send(
                    hello=pb.Hello(
                        **asdict(hello), agent_version=AGENT_VERSION, protocol_version=PROTOCOL_VERSION
                    )
                )
                # wait for the gateway's verdict on the hello: a refusal then arrives as a clear
                # status rather than as a failed write of the snapshot
                first = await call.read()
                if first is grpc.aio.EOF:
                    await self._raise_status(call)
                    return False
                kbs = first.ack.key_block_size if first.WhichOneof("body") == "ack" else 0
                rekey = self.src.on_key_block_size
                if kbs and kbs != hello.block_size and rekey is not None and rekey(kbs):
                    log.info("gateway keys at %d tokens, hello said %d: re-keying", kbs, hello.block_size)
                    return True  # say hello again once the inventory is keyed at the gateway's size
                reader = asyncio.create_task(self._read(call), name="agent-gateway-reader")
                self._last_sent.clear()
                # a hybrid flag reaches the gateway before the keys whose matching it changes
                await self._send_changed(send, "engine", self.src.engine() if self.src.engine else None)
                await self._send_snapshot(send)
                self.stats.connects += 1
                self.connected.set()
                log.info("streaming inventory to %s as %s", self.link.target, hello.replica_id)
                while True:
                    if reader.done():
                        reader.result()  # raises the stream's error
                        return True  # the gateway closed the stream cleanly
                    await self._flush(send)
                    wake = asyncio.ensure_future(self.outbox.wake.wait())
                    done, _ = await asyncio.wait({wake, reader}, return_when=asyncio.FIRST_COMPLETED)
                    if wake not in done:
                        wake.cancel()
                    self.outbox.wake.clear()
                    if self.link.flush_interval_s > 0:
                        await asyncio.sleep(self.link.flush_interval_s)  # let a batch gather
            finally:
                if reader is not None:
                    reader.cancel()
                    with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                        await reader
                call.cancel()

    async def _read(self, call: grpc.aio.StreamStreamCall[pb.AgentMessage, pb.GatewayMessage]) -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                await self._raise_status(call)
                return
            assert isinstance(msg, pb.GatewayMessage)
            kind = msg.WhichOneof("body")
            if kind == "ack":
                self.stats.acked_seq = msg.ack.seq
            elif kind == "resync":
                self.stats.resyncs_received += 1
                log.info("gateway asked for a snapshot: %s", msg.resync.reason)
                self.outbox.need_snapshot = True
                self.outbox.wake.set()
            elif kind == "held":  # a recovery hint (recovery.py): applied at once, never awaited
                self.inventory.held_prefix(list(msg.held.keys), list(msg.held.next_tokens))

    @staticmethod
    async def _raise_status(call: grpc.aio.StreamStreamCall[pb.AgentMessage, pb.GatewayMessage]) -> None:
        """The gateway ended the stream: raise its status unless it is OK."""
        code = await call.code()
        if code != grpc.StatusCode.OK:
            raise grpc.aio.AioRpcError(
                code, await call.initial_metadata(), await call.trailing_metadata(), await call.details()
            )

    async def _flush(self, send: Callable[..., Awaitable[None]]) -> None:
        outbox = self.outbox
        # first: a hybrid flag reaches the gateway before the keys whose matching it changes
        await self._send_changed(send, "engine", self.src.engine() if self.src.engine else None)
        if outbox.need_snapshot:
            await self._send_snapshot(send)
        events = outbox.take()
        if events:
            await send(events=pb.Events(events=events, engine_ts=outbox.engine_ts))
        await self._send_changed(send, "state", self.src.state() if self.src.state else None)
        await self._send_changed(send, "load", self.src.load() if self.src.load else None)

    async def _send_changed(
        self, send: Callable[..., Awaitable[None]], body: str, msg: Message | None
    ) -> None:
        """Send ``msg`` as the message body ``body`` unless it is None or equals the last one of
        that body sent on this stream."""
        if msg is None:
            return
        raw = msg.SerializeToString()
        if raw != self._last_sent.get(body):
            self._last_sent[body] = raw
            await send(**{body: msg})

    async def _send_snapshot(self, send: Callable[..., Awaitable[None]]) -> None:
        # taking the copy and reopening the outbox happen in one synchronous step: every delta
        # queued from here on comes after the snapshot
        entries = self.inventory.snapshot()
        self.outbox.reopen()
        self._snapshot_id += 1
        by_medium: dict[str, list[int]] = {}
        for k, medium in entries.items():
            by_medium.setdefault(medium, []).append(k)
        chunks: list[tuple[str, list[int]]] = []
        for medium, keys in by_medium.items():
            for i in range(0, len(keys), SNAPSHOT_CHUNK):
                chunks.append((medium, keys[i : i + SNAPSHOT_CHUNK]))
        if not chunks:
            chunks.append((GPU, []))
        for i, (medium, keys) in enumerate(chunks):
            await send(
                snapshot=pb.SnapshotChunk(
                    snapshot_id=self._snapshot_id,
                    keys=keys,
                    medium=wire_medium(medium),
                    last=i == len(chunks) - 1,
                )
            )
        self.stats.snapshots_sent += 1
