"""Asking an engine's replay endpoint (vLLM's and SGLang's ZMQ ROUTER) for its buffered KV-event
batches from a sequence number on (docs/agent.md): the subscriber's one request and its answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplayAsk:
    ctx: zmq.asyncio.Context
    endpoint: str
    timeout_s: float
    max_batches: int

    async def batches(
        self, start: int, seq_of: Callable[[list[bytes], int], int | None]
    ) -> list[tuple[int, bytes]] | None:
        """The batches from ``start`` on as (seq, payload); None when the endpoint did not answer
        in time or sent more than ``max_batches``. ``seq_of(frames, 2)`` reads a reply's seq (None:
        a malformed reply, skipped)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoint)
        out: list[tuple[int, bytes]] = []
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
                    return out
                out.append((seq, frames[1]))
            return None
        finally:
            with contextlib.suppress(zmq.ZMQError):
                dealer.close(linger=0)
