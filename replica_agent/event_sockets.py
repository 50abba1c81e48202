"""The agent's sockets on its engine's KV-event stream: the SUB socket, its monitor, and one
wake-up for both, on which subscriber.py's run loop waits.

Each socket's file descriptor is registered with the event loop once, for the sockets' life, and
the sockets are read without blocking through plain (not asyncio) pyzmq sockets. zmq.asyncio's
Poller added and removed both descriptors and made futures on every wait, and waited at most
100 ms, so an idle agent's event loop took 5.0-5.5 ms of CPU a second (1.5 without; docs/performance.md,
"The agent's wake-ups").

ZMQ's descriptor is edge-triggered: it becomes readable when the socket's state may have
changed, and reading ``EVENTS`` takes that in. So ``pending`` clears the wake-up first and then
reads both sockets' ``EVENTS``: a message that came before that read is seen there, and one that
comes after it sets the wake-up again.
"""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio
import zmq.utils.monitor

_WATCHED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED


def _readable(sock: zmq.Socket[bytes]) -> bool:
    events = sock.get(zmq.EVENTS)
    assert isinstance(events, int)
    return bool(events & zmq.POLLIN)


class EventSockets:
    """Owned by one ``EventSubscriber.run``, which calls ``close`` when it ends."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, topic: bytes) -> None:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 1_000_000)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        monitor = sub.get_monitor_socket(_WATCHED)
        sub.connect(endpoint)
        self._owned = (sub, monitor)
        self.sub: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        self.monitor: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
        self.wake = asyncio.Event()  # set when either socket's state may have changed, or by ``poke``
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sub.FD, self.wake.set)
        self._loop.add_reader(self.monitor.FD, self.wake.set)

    def pending(self) -> tuple[bool, bool]:
        """Whether the SUB socket, and the monitor, have a message to read now."""
        self.wake.clear()
        return _readable(self.sub), _readable(self.monitor)

    async def wait(self, timeout_s: float | None) -> None:
        """Until a socket's state changes, ``poke`` is called, or ``timeout_s`` (None: no limit)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout_s)

    def poke(self) -> None:
        """End the current ``wait`` (something other than the sockets needs the loop)."""
        self.wake.set()

    def monitor_event(self) -> int:
        """The monitor's next event's kind, ``zmq.EVENT_*`` (call when ``pending`` says it has one)."""
        return zmq.utils.monitor.parse_monitor_message(self.monitor.recv_multipart())["event"]

    def close(self) -> None:
        self._loop.remove_reader(self.sub.FD)
        self._loop.remove_reader(self.monitor.FD)
        sub, monitor = self._owned
        with contextlib.suppress(zmq.ZMQError):
            sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)
