"""Asking an engine's replay endpoint (vLLM's and SGLang's ZMQ ROUTER) for its buffered KV-event
batches from a sequence number on (docs/agent.md): the subscriber's request and its answer.

With ``keep`` the DEALER socket (and its connection to the engine) serves the next ask too, but
only after an ask that ended cleanly (the engine's end marker read): after a timeout, a refusal
of too many batches or an error, frames of that answer may still come, so the socket is closed
and the next ask opens a new one. A quiet stream asks once per quiet period (subscriber.py's tail
probe); a connection per ask cost the agent and the engine a ZMTP handshake each time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReplayAsk:
    ctx: zmq.asyncio.Context
    endpoint: str
    timeout_s: float
    max_batches: int
    keep: bool = False  # the socket serves the next ask after a clean answer (``close`` ends it)
    _dealer: zmq.asyncio.Socket | None = field(default=None, init=False)

    def close(self) -> None:
        dealer, self._dealer = self._dealer, None
        if dealer is not None:
            with contextlib.suppress(zmq.ZMQError):
                dealer.close(linger=0)

    def _socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.endpoint)
            self._dealer = dealer
        return self._dealer

    async def batches(
        self, start: int, seq_of: Callable[[list[bytes], int], int | None]
    ) -> list[tuple[int, bytes]] | None:
        """The batches from ``start`` on as (seq, payload); None when the endpoint did not answer
        in time or sent more than ``max_batches``. ``seq_of(frames, 2)`` reads a reply's seq (None:
        a malformed reply, skipped)."""
        dealer = self._socket()
        out: list[tuple[int, bytes]] = []
        clean = False
        try:
            try:
                # a DEALER's send waits for a connected peer: bound it, or a replay endpoint that
                # is down (or wrong) would stop the subscriber for good
                await asyncio.wait_for(dealer.send_multipart([b"", start.to_bytes(8, "big")]), self.timeout_s)
            except TimeoutError:
                log.warning("replay endpoint %s not reachable", self.endpoint)
                return None
            while len(out) <= self.max_batches:
                if not await dealer.poll(int(self.timeout_s * 1000)):
                    log.warning("replay from seq %d timed out after %d batches", start, len(out))
                    return None
                frames: list[Any] = await dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # topic, seq, payload
                    frames = frames[1:]
                seq = seq_of(frames, 2)
                if seq is None:
                    continue
                if seq == -1:
                    clean = True
                    return out
                out.append((seq, frames[1]))
            return None
        finally:
            if not (clean and self.keep):
                self.close()
