"""KV-cache events on the wire exactly as vLLM publishes them, plus a fault switch for tests.

Wire format (vllm/distributed/kv_events.py, ZmqEventPublisher, and ../shared/REAL_ENGINES.md):
- PUB frames ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter starting at 0 in every
  process (so it restarts with the engine); ``payload`` msgpack ``[ts, events, data_parallel_rank]``.
- Events are msgpack maps with a ``type`` key (msgspec tagged structs, current releases) or, with
  ``EventEncoding.ARRAY``, the older tagged arrays ``["BlockStored", hashes, parent, tokens, ...]``.
- Replay: a ROUTER socket. A DEALER sends ``["", start_seq]``; the engine answers one
  ``["", topic, seq, payload]`` per buffered batch with ``seq >= start_seq``, then
  ``["", "", -1, ""]`` (seq -1 as a signed 8-byte big-endian int). The buffer holds the last
  ``replay_buffer`` batches (a bounded deque, as vLLM's ``buffer_steps``).

The fault switch acts on the next N batches at publish time: ``drop`` (the batch gets its seq and
stays in the replay buffer, so a subscriber sees a gap it can recover; with ``from_replay`` it is
also left out of the buffer, so the gap cannot be recovered), ``duplicate`` (sent twice with the
same seq) and ``reorder`` (held back and sent right after the batch that follows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_FAULT_COUNT = 1_000_000


class EventEncoding(Enum):
    MAP = "map"
    ARRAY = "array"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int | bytes]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_to_wire(event: KvEvent, encoding: EventEncoding) -> Any:
    """One event as vLLM's msgspec encoder would emit it (fields with defaults are omitted,
    fields without defaults are always present, nil when None)."""
    if isinstance(event, BlockStored):
        if encoding is EventEncoding.ARRAY:
            return [
                "BlockStored",
                event.block_hashes,
                event.parent_block_hash,
                event.token_ids,
                event.block_size,
                None,
                event.medium,
            ]
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        if encoding is EventEncoding.ARRAY:
            return ["BlockRemoved", event.block_hashes, event.medium]
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    if encoding is EventEncoding.ARRAY:
        return ["AllBlocksCleared"]
    return {"type": "AllBlocksCleared"}


def encode_batch(events: Sequence[KvEvent], encoding: EventEncoding, ts: float, dp_rank: int = 0) -> bytes:
    return msgpack.packb([ts, [event_to_wire(e, encoding) for e in events], dp_rank], use_bin_type=True)  # type: ignore[no-any-return]


@dataclass(slots=True)
class FaultState:
    """Remaining counts of the fault switch (batches still to be affected)."""

    drop: int = 0
    drop_from_replay: bool = False
    duplicate: int = 0
    reorder: int = 0

    def as_dict(self) -> dict[str, int | bool]:
        return {
            "drop": self.drop,
            "from_replay": self.drop_from_replay,
            "duplicate": self.duplicate,
            "reorder": self.reorder,
        }


@dataclass(slots=True)
class PublisherStats:
    batches: int = 0  # seqs assigned
    sent: int = 0  # frames sent on PUB (duplicates count twice)
    dropped: int = 0
    replay_requests: int = 0


class KvEventPublisher:
    """PUB + ROUTER publisher. ``publish`` is synchronous and never blocks (PUB drops at its HWM),
    so the engine task can call it between steps; the replay socket is served by one task owned by
    this object, started by ``start`` and stopped by ``close``."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        replay_buffer: int,
        encoding: EventEncoding,
        hwm: int = 100_000,
    ) -> None:
        if replay_buffer <= 0:
            raise ValueError("replay_buffer must be positive")
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._encoding = encoding
        self._hwm = hwm
        # Invariant: seqs in the buffer are strictly increasing; its length never exceeds replay_buffer.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_buffer)
        self._next_seq = 0
        self._held: tuple[int, bytes] | None = None
        self.faults = FaultState()
        self.stats = PublisherStats()
        self._sync_ctx: zmq.Context[Any] | None = None
        self._async_ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def start(self) -> None:
        """Bind both sockets (raises zmq.ZMQError when a port is taken) and start replay service."""
        self._sync_ctx = zmq.Context()
        self._pub = self._sync_ctx.socket(zmq.PUB)
        self._pub.set_hwm(self._hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self._endpoint)
        if self._replay_endpoint is not None:
            self._async_ctx = zmq.asyncio.Context()
            self._router = self._async_ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(self._replay_endpoint)
            self._replay_task = asyncio.create_task(self._serve_replay(), name="sim-engine-replay")

    def bound_endpoint(self) -> str:
        assert self._pub is not None, "publisher not started"
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    def bound_replay_endpoint(self) -> str | None:
        if self._router is None:
            return None
        return str(self._router.getsockopt_string(zmq.LAST_ENDPOINT))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        if self._async_ctx is not None:
            self._async_ctx.term()
            self._async_ctx = None
        if self._sync_ctx is not None:
            self._sync_ctx.term()
            self._sync_ctx = None

    def set_faults(self, drop: int, from_replay: bool, duplicate: int, reorder: int) -> None:
        for name, value in (("drop", drop), ("duplicate", duplicate), ("reorder", reorder)):
            if not 0 <= value <= MAX_FAULT_COUNT:
                raise ValueError(f"{name} must be in [0, {MAX_FAULT_COUNT}]")
        self.faults = FaultState(drop, from_replay, duplicate, reorder)

    def publish(self, events: Sequence[KvEvent]) -> int:
        """Encode one engine step's events as one batch, assign it the next seq and send it
        (subject to the fault switch). Returns the seq."""
        seq = self._next_seq
        self._next_seq += 1
        self.stats.batches += 1
        payload = encode_batch(events, self._encoding, time.time())
        f = self.faults
        if f.drop > 0:
            f.drop -= 1
            self.stats.dropped += 1
            if not f.drop_from_replay:
                self._buffer.append((seq, payload))
            return seq
        self._buffer.append((seq, payload))
        if f.reorder > 0 and self._held is None:
            f.reorder -= 1
            self._held = (seq, payload)
            return seq
        self._send(seq, payload)
        if f.duplicate > 0:
            f.duplicate -= 1
            self._send(seq, payload)
        if self._held is not None:
            held, self._held = self._held, None
            self._send(*held)
        return seq

    def _send(self, seq: int, payload: bytes) -> None:
        assert self._pub is not None, "publisher not started"
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.stats.sent += 1
        except zmq.Again:
            # PUB at its high-water mark: the subscriber sees a gap and replays, as with vLLM.
            log.warning("kv-events PUB at high-water mark; batch %d not sent", seq)

    async def _serve_replay(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request (%d frames)", len(frames))
                continue
            client_id, _, start_bytes = frames
            self.stats.replay_requests += 1
            start = int.from_bytes(start_bytes, "big")
            # Snapshot first: publish() may append while we await sends.
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart(
                        (client_id, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await router.send_multipart((client_id, b"", b"", END_SEQ, b""))
