"""A stand-in for an engine's KV-event publisher on real ZMQ sockets (vLLM's protocol), for the
agent subscriber's tests."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from gateway.asyncio_tasks import cancel_and_wait
from replica_agent.inventory import AgentInventory
from replica_agent.subscriber import EventSubscriber
from tests.polling import until


class Publisher:
    """vLLM's ZmqEventPublisher behaviour: PUB frames [topic, seq, payload], a ROUTER that replays
    buffered batches from a start seq then sends seq -1."""

    def __init__(self, ctx: zmq.asyncio.Context, buffer: int = 100) -> None:
        self.ctx = ctx
        # XPUB: a PUB that also hands over its subscribers' subscriptions (``subscribed``)
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.replays_answered = 0
        self.askers: list[bytes] = []  # the identity of the DEALER socket of each replay ask
        self.mute = 0  # replay asks left unanswered from now on (a hung engine)
        self.seq = 0
        self.ts = 1000.0
        self._task = asyncio.create_task(self._serve_replay())

    def subscriber(self, inv: AgentInventory, replay: bool | int = True, **kw: Any) -> EventSubscriber:
        """An agent subscriber of this publisher, replaying from its ROUTER (``True``), from
        another port (an int), or not at all (``False``)."""
        port = self.replay_port if replay is True else replay
        endpoint = f"tcp://127.0.0.1:{port}" if port is not False else None
        return EventSubscriber(self.ctx, f"tcp://127.0.0.1:{self.pub_port}", endpoint, inv, **kw)

    async def _serve_replay(self) -> None:
        while True:
            ident, _empty, start = await self.router.recv_multipart()
            self.askers.append(ident)
            if self.mute:
                self.mute -= 1
                continue
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    await self.router.send_multipart([ident, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
            self.replays_answered += 1

    async def joined(self, replay: bool = True) -> None:
        """Wait until a new subscriber's subscription has reached this socket (from then on it
        gets what is published; before, a PUB socket drops it) and, with ``replay``, its start-up
        replay has been answered (what is published from then on is not in that answer)."""
        while (await asyncio.wait_for(self.pub.recv(), 5.0))[:1] != b"\x01":
            pass  # an unsubscription (a subscriber gone)
        if replay:
            await until(lambda: self.replays_answered >= 1, timeout_s=5.0, interval_s=0.01)

    def batch(self, events: list[Any]) -> tuple[int, bytes]:
        self.ts += 1.0
        payload = msgpack.packb([self.ts, events, 0])
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        return seq, payload

    async def send(self, seq: int, payload: bytes) -> None:
        await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    async def publish(self, events: list[Any]) -> tuple[int, bytes]:
        seq, payload = self.batch(events)
        await self.send(seq, payload)
        return seq, payload

    def restart(self) -> None:
        """The engine restarted: seq from 0, empty buffer (the clock goes on)."""
        self.seq = 0
        self.buffer.clear()

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self.pub.close(linger=0)
        self.router.close(linger=0)
