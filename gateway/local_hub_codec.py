"""The frames of the local channel between the inventory owner (the parent process) and its HTTP
workers (``kvgate serve --workers N``; docs/architecture.md, "Workers").

A frame is ``uint32 LE length`` then ``length`` bytes: one byte of kind, then its payload. The
inventory payloads reuse the shared-state encodings (gateway/shared_state_codec.py): a
registration is ``encode_hello``, a snapshot ``encode_snapshot``, a batch of ops ``encode_ops``.
A replica-addressed payload starts with the replica id (uint16 LE length, UTF-8). Small control
frames carry JSON (orjson).

Parent to worker: ``H`` registration, ``A`` agent link state, ``E`` engine state, ``N`` engine
load, ``C`` health-check result, ``S`` precise snapshot, ``V`` speculative entries (key, expiry),
``O`` ops, ``T`` another worker's speculative touch, ``R`` the other workers' load, ``U`` a
replica's TTFT fit, ``Q`` reload, ``G`` metrics pull, ``M`` merged metrics, ``Y`` end of the
initial state.
Worker to parent: ``W`` hello (worker number, pid), ``K`` listening, ``T`` speculative touch,
``L`` this worker's load (gateway/local_hub_load.py), ``F`` a first token (gateway/workers_ttft.py),
``P`` held-prefix hint, ``Q`` reloaded, ``X`` metrics request, ``g`` metrics answer.

Decoders raise ``CodecError`` on malformed input.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Any

import numpy as np
import orjson

from gateway.shared_state_codec import CodecError

log = logging.getLogger("kvgate.workers")

_LEN = struct.Struct("<I")
_RLEN = struct.Struct("<H")
_TOUCH = struct.Struct("<d")
_KEY = np.dtype("<u8")
_STAMP = np.dtype("<f8")


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return _LEN.pack(len(kind) + len(payload)) + kind + payload


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> tuple[bytes, bytes]:
    """The next frame's (kind, payload); raises ``asyncio.IncompleteReadError`` at EOF and
    ``CodecError`` for a frame over ``max_bytes`` (read before allocating it)."""
    (size,) = _LEN.unpack(await reader.readexactly(4))
    if size == 0 or size > max_bytes:
        raise CodecError(f"frame of {size} bytes (bound {max_bytes})")
    body = await reader.readexactly(size)
    return body[:1], body[1:]


def encode_json(kind: bytes, doc: Any) -> bytes:
    return frame(kind, orjson.dumps(doc))


def decode_json(payload: bytes) -> Any:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise CodecError(f"malformed control frame: {exc}") from None


def encode_replica(kind: bytes, replica: str, payload: bytes) -> bytes:
    raw = replica.encode()
    return frame(kind, _RLEN.pack(len(raw)) + raw + payload)


def decode_replica(payload: bytes) -> tuple[str, bytes]:
    if len(payload) < 2:
        raise CodecError("truncated replica id")
    (n,) = _RLEN.unpack_from(payload)
    raw = payload[2 : 2 + n]
    if len(raw) != n:
        raise CodecError("truncated replica id")
    try:
        return raw.decode(), payload[2 + n :]
    except UnicodeDecodeError as exc:
        raise CodecError(f"replica id is not UTF-8: {exc}") from None


def encode_touch(replica: str, keys: Any, lifetime_s: float) -> bytes:
    """A speculative touch: the keys a routed request recorded and their lifetime."""
    return encode_replica(b"T", replica, _TOUCH.pack(lifetime_s) + np.asarray(keys, dtype=_KEY).tobytes())


def decode_touch(payload: bytes) -> tuple[str, list[int], float]:
    replica, rest = decode_replica(payload)
    if len(rest) < 8 or (len(rest) - 8) % 8:
        raise CodecError("malformed touch")
    (lifetime,) = _TOUCH.unpack_from(rest)
    return replica, np.frombuffer(rest, dtype=_KEY, offset=8).tolist(), lifetime


def encode_tagged(kind: bytes, tag: int, payload: bytes) -> bytes:
    """A payload numbered by a request id (metrics pulls and answers)."""
    return frame(kind, _LEN.pack(tag) + payload)


def decode_tagged(payload: bytes) -> tuple[int, bytes]:
    if len(payload) < 4:
        raise CodecError("truncated tag")
    return _LEN.unpack_from(payload)[0], payload[4:]


def encode_stamps(replica: str, pairs: list[tuple[int, float]]) -> bytes:
    """A replica's speculative entries as (key, monotonic expiry) pairs, eviction order first
    (CLOCK_MONOTONIC is one clock for every process of the host)."""
    keys = np.fromiter((k for k, _ in pairs), dtype=_KEY, count=len(pairs))
    stamps = np.fromiter((t for _, t in pairs), dtype=_STAMP, count=len(pairs))
    return encode_replica(b"V", replica, keys.tobytes() + stamps.tobytes())


def decode_stamps(payload: bytes) -> tuple[str, list[int], list[float]]:
    replica, rest = decode_replica(payload)
    if len(rest) % 16:
        raise CodecError("malformed speculative entries")
    n = len(rest) // 16
    keys = np.frombuffer(rest, dtype=_KEY, count=n).tolist()
    stamps = np.frombuffer(rest, dtype=_STAMP, offset=8 * n, count=n).tolist()
    return replica, keys, stamps


class FrameWriter:
    """One side's writes to the channel, coalesced: frames queued during one turn of the event
    loop (``window_s`` 0), or within ``window_s`` of the first one queued, go out in one write at
    its end. At most ``max_bytes`` wait (queued or in the transport's buffer); beyond, the channel
    is aborted (the worker is then restarted and resynced). Order is kept: frames go out in the
    order they were queued."""

    def __init__(
        self, writer: asyncio.StreamWriter, max_bytes: int, name: str, window_s: float = 0.0
    ) -> None:
        assert window_s >= 0
        self._writer = writer
        self._max = max_bytes
        self._name = name
        self._window_s = window_s
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._timer: asyncio.TimerHandle | None = None

    def send(self, data: bytes) -> None:
        transport = self._writer.transport
        if transport.is_closing():
            return
        if self._pending_bytes + len(data) + transport.get_write_buffer_size() > self._max:
            log.error("%s: %d bytes not sent; closing the channel", self._name, self._max)
            self._pending.clear()
            transport.abort()
            return
        if not self._pending:
            loop = asyncio.get_running_loop()
            if self._window_s:
                self._timer = loop.call_later(self._window_s, self._flush)
            else:
                loop.call_soon(self._flush)
        self._pending.append(data)
        self._pending_bytes += len(data)

    def _flush(self) -> None:
        self._timer = None
        data = b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        if data and not self._writer.transport.is_closing():
            self._writer.write(data)

    def abort(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._pending.clear()
        self._pending_bytes = 0
        self._writer.transport.abort()
