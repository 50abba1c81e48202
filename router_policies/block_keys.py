"""The block-key contract shared by the replica agent and the gateway (docs/architecture.md, "Block keys").

    root    = xxh3_64(b"kvgate:v1:" + namespace)
    key[i]  = xxh3_64(key[i-1].to_bytes(8, "little") + tokens[i*B:(i+1)*B] as little-endian uint32)

with ``key[-1] = root``. Keys are unsigned 64-bit ints. Only full blocks are keyed.

The namespace is the model name, then ``"\\x00lora:" + adapter`` when a LoRA adapter is named and
``"\\x00salt:" + cache_salt`` when the request carries one. NUL cannot occur in a model name given
through YAML/HTTP in practice, so distinct (model, adapter, salt) triples never share a namespace.

The token ids are converted to bytes once with numpy; the only Python loop is one xxh3 call per
block, never one step per token.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

_ROOT_PREFIX = b"kvgate:v1:"
_STRUCT_MAX = 2048  # lists up to this length are packed with struct
_xxh3 = xxhash.xxh3_64_intdigest


def namespace_bytes(model: str, lora: str | None = None, cache_salt: str | None = None) -> bytes:
    ns = model.encode()
    if lora:
        ns += b"\x00lora:" + lora.encode()
    if cache_salt:
        ns += b"\x00salt:" + cache_salt.encode()
    return ns


def root_key(model: str, lora: str | None = None, cache_salt: str | None = None) -> int:
    return _xxh3(_ROOT_PREFIX + namespace_bytes(model, lora, cache_salt))


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes (ids must fit in 32 bits)."""
    if type(tokens) is list and len(tokens) <= _STRUCT_MAX:
        # short lists (one engine event's blocks): struct packs them about 2x faster than numpy,
        # into the same bytes
        try:
            return struct.pack(f"<{len(tokens)}I", *tokens)
        except struct.error:
            raise ValueError("token ids must be in [0, 2**32)") from None
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32:
        # the gateway's token arrays: in range by their type, so no check and no int64 copy
        return tokens.astype("<u4", copy=False).tobytes()
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def chain_keys(parent: int, tokens: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Keys of the full blocks of ``tokens`` chained after ``parent``; a trailing partial block is
    ignored."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    raw = token_bytes(tokens)
    step = 4 * block_size
    n_blocks = len(raw) // step
    keys: list[int] = []
    append = keys.append
    prev = parent
    for off in range(0, n_blocks * step, step):
        prev = _xxh3(prev.to_bytes(8, "little") + raw[off : off + step])
        append(prev)
    return keys


def block_keys(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    model: str,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Keys of every full block of a prompt in the given namespace."""
    return chain_keys(root_key(model, lora, cache_salt), tokens, block_size)
