"""The engine's own block hashes, deliberately unlike kvgate's keys.

vLLM hashes a block with sha256 over (parent hash, token ids, extra keys) and publishes either the
32-byte digest or, by default, its last 8 bytes as an unsigned big-endian int (often above 2**63).
We do the same shape of thing with our own byte layout: consumers must never be able to compute
these hashes themselves, only map them (which is what the replica agent does).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from enum import Enum

import numpy as np

_ROOT_PREFIX = b"kvgate-sim-engine:v1:"


class HashFormat(Enum):
    INT = "int"
    BYTES = "bytes"


def root_digest(namespace: str) -> bytes:
    """The chain's starting digest for one model namespace (never published itself)."""
    return hashlib.sha256(_ROOT_PREFIX + namespace.encode()).digest()


def block_digest(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """sha256(parent digest || token ids as little-endian uint32)."""
    raw = np.asarray(tokens, dtype=np.int64).astype("<u4").tobytes()
    return hashlib.sha256(parent + raw).digest()


def external_hash(digest: bytes, fmt: HashFormat) -> int | bytes:
    """What goes on the wire: vLLM's int form (last 8 bytes, big-endian, unsigned) or the digest."""
    if fmt is HashFormat.INT:
        return int.from_bytes(digest[-8:], "big")
    return digest
