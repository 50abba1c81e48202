"""The bytes kvgate writes to Redis for shared state (docs/shared-state.md), and the Redis key names.

An inventory *ops* payload is a run of ``gateway.inventory_ops.Op`` (the ops the inventory server
applied), each one byte of kind then its operands:

* ``s`` stored: medium length (1 byte), medium (UTF-8), key count (uint32 LE), keys (uint64 LE each)
* ``r`` removed: key count (uint32 LE), keys (uint64 LE each)
* ``c`` cleared: nothing

A snapshot is the same encoding with one ``s`` run per medium, so it decodes to ``key -> medium``.
Keys travel as packed little-endian uint64 (8 bytes a key, no per-key framing), so a stream entry
of 64 blocks is ~520 bytes and decoding is one ``numpy.frombuffer`` per run.

A load value is ``requests,tokens,prefill,owned,running,waiting,kv_usage`` in ASCII: the first three
are what the publishing instance routed and has not finished; when ``owned`` is 1 the publisher
holds the replica's agent stream and the last three are the engine's own figures.

A registration is the replica's ``AgentHello`` as JSON.

Decoders raise ``CodecError`` on any malformed input, never return a partial result.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from gateway.inventory_ops import Op
from gateway.inventory_sink import AgentHello
from proto.contract import GPU

__all__ = [
    "CodecError",
    "Header",
    "Keys",
    "LoadFigures",
    "SnapshotBoundError",
    "decode_header",
    "decode_hello",
    "decode_load",
    "decode_ops",
    "decode_snapshot",
    "encode_header",
    "encode_hello",
    "encode_load",
    "encode_ops",
    "encode_snapshot",
    "parse_stream_id",
]

_COUNT = struct.Struct("<I")
_KEY = np.dtype("<u8")


class CodecError(ValueError):
    """Bytes from Redis that do not decode (a foreign writer, or a newer format)."""


class SnapshotBoundError(CodecError):
    """A snapshot holds more keys than the reader's per-replica bound."""


def _pack_keys(keys: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(keys, dtype=_KEY).tobytes()


def encode_ops(ops: Iterable[Op]) -> bytes:
    parts: list[bytes] = []
    for op in ops:
        if op.kind == "c":
            parts.append(b"c")
            continue
        body = _COUNT.pack(len(op.keys)) + _pack_keys(op.keys)
        if op.kind == "s":
            medium = op.medium.encode()
            if len(medium) > 255:
                raise CodecError(f"medium name longer than 255 bytes: {op.medium[:40]!r}")
            parts.append(b"s" + bytes((len(medium),)) + medium + body)
        else:
            parts.append(b"r" + body)
    return b"".join(parts)


def decode_ops(data: bytes) -> Iterator[Op]:
    view = memoryview(data)
    pos, end = 0, len(data)
    while pos < end:
        kind = data[pos : pos + 1]
        pos += 1
        if kind == b"c":
            yield Op("c")
            continue
        medium = GPU
        if kind == b"s":
            if pos >= end:
                raise CodecError("truncated medium")
            n = data[pos]
            medium_raw = bytes(view[pos + 1 : pos + 1 + n])
            if len(medium_raw) != n:
                raise CodecError("truncated medium")
            try:
                medium = medium_raw.decode()
            except UnicodeDecodeError as exc:
                raise CodecError(f"medium is not UTF-8: {exc}") from None
            pos += 1 + n
        elif kind != b"r":
            raise CodecError(f"unknown op {kind!r} at byte {pos - 1}")
        if pos + 4 > end:
            raise CodecError("truncated key count")
        (count,) = _COUNT.unpack_from(data, pos)
        pos += 4
        stop = pos + 8 * count
        if stop > end:
            raise CodecError(f"{count} keys announced, {(end - pos) // 8} present")
        keys = np.frombuffer(view[pos:stop], dtype=_KEY).tolist()
        pos = stop
        yield Op("s" if kind == b"s" else "r", keys, medium)


def encode_snapshot(entries: Mapping[int, str]) -> bytes:
    by_medium: dict[str, list[int]] = {}
    for key, medium in entries.items():
        by_medium.setdefault(medium, []).append(key)
    return encode_ops(Op("s", keys, medium) for medium, keys in by_medium.items())


def decode_snapshot(data: bytes, bound: int) -> dict[int, str]:
    """``key -> medium``; refuses a snapshot of more than ``bound`` keys before building it."""
    entries: dict[int, str] = {}
    for op in decode_ops(data):
        if op.kind != "s":
            raise CodecError(f"snapshot holds a {op.kind!r} op")
        if len(entries) + len(op.keys) > bound:
            raise SnapshotBoundError(f"snapshot exceeds the bound of {bound} blocks per replica")
        for k in op.keys:
            entries[k] = op.medium
    return entries


# ---------------------------------------------------------------------- registrations
def encode_hello(h: AgentHello) -> bytes:
    """A replica's registration (its agent's Hello) as JSON."""
    return orjson.dumps(
        {
            "replica_id": h.replica_id,
            "url": h.url,
            "models": list(h.models),
            "block_size": h.block_size,
            "capacity_blocks": h.capacity_blocks,
            "engine": h.engine,
            "engine_version": h.engine_version,
            "agent_version": h.agent_version,
        }
    )


def decode_hello(raw: bytes) -> AgentHello:
    try:
        d = orjson.loads(raw)
        return AgentHello(
            replica_id=str(d["replica_id"]),
            url=str(d["url"]),
            models=tuple(str(m) for m in d["models"]),
            block_size=int(d["block_size"]),
            capacity_blocks=int(d["capacity_blocks"]),
            engine=str(d["engine"]),
            engine_version=str(d["engine_version"]),
            agent_version=str(d["agent_version"]),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CodecError(f"malformed registration: {exc}") from None


# ---------------------------------------------------------------------- load
@dataclass(frozen=True, slots=True)
class LoadFigures:
    requests: int
    tokens: int
    prefill: int
    owned: bool = False
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


def encode_load(f: LoadFigures) -> bytes:
    return (
        f"{f.requests},{f.tokens},{f.prefill},{int(f.owned)},{f.running},{f.waiting},{f.kv_usage:.4f}"
    ).encode()


def decode_load(data: bytes) -> LoadFigures:
    try:
        parts = data.decode().split(",")
        if len(parts) != 7:
            raise ValueError(f"{len(parts)} fields")
        return LoadFigures(
            requests=int(parts[0]),
            tokens=int(parts[1]),
            prefill=int(parts[2]),
            owned=parts[3] == "1",
            running=int(parts[4]),
            waiting=int(parts[5]),
            kv_usage=float(parts[6]),
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise CodecError(f"malformed load value {data[:60]!r}: {exc}") from None


# ---------------------------------------------------------------------- stream entries
@dataclass(frozen=True, slots=True)
class Header:
    """A stream entry's header: kind (``d`` delta, ``S`` snapshot marker), the owner's per-replica
    counter, the owner's wall clock when it applied the mutation, and the owner's instance id."""

    kind: bytes
    n: int
    ts: float
    origin: bytes


def encode_header(h: Header) -> bytes:
    # one field instead of four: the reader's RESP parsing is per field, and dominates following
    return b"%s %d %r %s" % (h.kind, h.n, h.ts, h.origin)


def decode_header(raw: bytes) -> Header:
    parts = raw.split(b" ", 3)
    if len(parts) != 4 or parts[0] not in (b"d", b"S"):
        raise CodecError(f"malformed entry header {raw[:60]!r}")
    try:
        return Header(parts[0], int(parts[1]), float(parts[2]), parts[3])
    except ValueError:
        raise CodecError(f"malformed entry header {raw[:60]!r}") from None


# ---------------------------------------------------------------------- stream ids
def parse_stream_id(raw: bytes | str) -> tuple[int, int]:
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
        ms, _, seq = text.partition("-")
        return int(ms), int(seq or 0)
    except (ValueError, UnicodeDecodeError):  # UnicodeDecodeError is a ValueError: said for the reader
        raise CodecError(f"malformed stream id {raw!r}") from None


# ---------------------------------------------------------------------- key names
@dataclass(frozen=True, slots=True)
class Keys:
    """Every Redis key kvgate uses, under one prefix."""

    prefix: str

    @property
    def replicas(self) -> str:
        """SET of replica ids whose inventory is shared."""
        return f"{self.prefix}:replicas"

    @property
    def instances(self) -> str:
        """SET of gateway instance ids that publish load."""
        return f"{self.prefix}:instances"

    def stream(self, replica: str) -> str:
        """STREAM of a replica's inventory deltas and snapshot markers."""
        return f"{self.prefix}:inv:{replica}"

    def snapshot(self, replica: str) -> str:
        """HASH: the replica's latest full inventory and the stream id it stands at."""
        return f"{self.prefix}:snap:{replica}"

    def replica(self, replica: str) -> str:
        """HASH: the replica's registration (url, models, block size, engine)."""
        return f"{self.prefix}:replica:{replica}"

    def load(self, instance: str) -> str:
        """HASH replica -> load value of one instance (expires after ``load_ttl_s``)."""
        return f"{self.prefix}:load:{instance}"
