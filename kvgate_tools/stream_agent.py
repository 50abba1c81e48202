"""A stand-in agent on the inventory stream (docs/architecture.md, section 4), for the tests, the
fault runs (``make faults``) and the benches: the agent messages they send, the way a
well-behaved agent sends them and reads the stream's status, and ``StreamAgent``, a blocking
agent that sends exactly what its caller says (so a test decides what the index holds).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import grpc
import grpc.aio

from proto.kvgate.v1 import inventory_pb2 as pb

SYNC = "/kvgate.v1.Inventory/Sync"


def hello(
    replica: str = "r0",
    url: str = "",
    *,
    seq: int = 1,
    block_size: int = 16,
    capacity: int = 100,
    version: int = 1,
) -> pb.AgentMessage:
    return pb.AgentMessage(
        seq=seq,
        hello=pb.Hello(
            replica_id=replica,
            url=url,
            block_size=block_size,
            capacity_blocks=capacity,
            models=["m"],
            engine="vllm",
            protocol_version=version,
        ),
    )


def snap(seq: int, keys: Sequence[int], sid: int = 1, last: bool = True) -> pb.AgentMessage:
    return pb.AgentMessage(seq=seq, snapshot=pb.SnapshotChunk(snapshot_id=sid, keys=list(keys), last=last))


def events(seq: int, *evs: pb.Event) -> pb.AgentMessage:
    return pb.AgentMessage(seq=seq, events=pb.Events(events=list(evs)))


def load(seq: int, kv_usage: float, running: int = 0, waiting: int = 0) -> pb.AgentMessage:
    return pb.AgentMessage(seq=seq, load=pb.Load(running=running, waiting=waiting, kv_usage=kv_usage))


def stored(*keys: int) -> pb.Event:
    return pb.Event(stored=pb.Stored(keys=list(keys)))


def removed(*keys: int) -> pb.Event:
    return pb.Event(removed=pb.Removed(keys=list(keys)))


def authorization(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """``token`` as a stream's whole authorization header (None: no header)."""
    return (("authorization", token),) if token is not None else None


def sync_call(
    channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]] | None
) -> grpc.aio.StreamStreamCall:
    """A Sync stream on ``channel``; its messages may be raw bytes (malformed on purpose)."""
    sync = channel.stream_stream(
        SYNC,
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
        response_deserializer=pb.GatewayMessage.FromString,
    )
    return sync(metadata=metadata)


async def status_after_reading(call: grpc.aio.StreamStreamCall) -> grpc.StatusCode:
    """The stream's status, read as an agent does: every message first (gRPC hands a client its
    status only once the messages before it are read)."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        while await call.read() is not grpc.aio.EOF:
            pass
    return await call.code()


class StreamCaller(Protocol):
    """Where ``run_stream`` opens its stream (a test's rig, ``ChannelCaller``)."""

    def call(self, token: str | None) -> grpc.aio.StreamStreamCall: ...


class ChannelCaller:
    """Sync streams on one channel, each with the token it is given (``authorization``)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    def call(self, token: str | None) -> grpc.aio.StreamStreamCall:
        return sync_call(self.channel, authorization(token))


async def run_stream(
    caller: StreamCaller, token: str | None, msgs: Sequence[pb.AgentMessage | bytes]
) -> grpc.StatusCode:
    """Send ``msgs`` as a well-behaved agent does, each after the previous one's Ack, and return
    the stream's status. (A grpc.aio client whose write fails after the server's status arrived
    reports INTERNAL instead of that status, grpc/grpc#36066; the real agent waits for the Hello's
    Ack for the same reason.)"""
    call = caller.call(token)
    try:
        for m in msgs:
            await call.write(m)
            if await call.read() is grpc.aio.EOF:
                return await call.code()
        await call.done_writing()
    except grpc.aio.AioRpcError:
        return await call.code()
    return await status_after_reading(call)


class StreamAgent:
    """A minimal blocking agent on the inventory stream of a gateway at 127.0.0.1:``port``: each
    ``send`` is one message (its seq numbered here), written in order by gRPC's request thread;
    the gateway's answers are read and dropped."""

    def __init__(self, port: int, token: str) -> None:
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self._queue: list[pb.AgentMessage] = []
        self._cond = threading.Condition()
        self._closed = False
        call = self._channel.stream_stream(
            SYNC,
            request_serializer=pb.AgentMessage.SerializeToString,
            response_deserializer=pb.GatewayMessage.FromString,
        )
        self._responses = call(self._requests(), metadata=(("authorization", f"Bearer {token}"),))
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self._seq = 0

    def _requests(self) -> Iterator[pb.AgentMessage]:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                msg = self._queue.pop(0)
            yield msg

    def _drain(self) -> None:
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass

    def send(self, **body: Any) -> None:
        self._seq += 1
        with self._cond:
            self._queue.append(pb.AgentMessage(seq=self._seq, **body))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._channel.close()
