"""Approximate block keys on characters, for models without a tokenizer (``tokenizer: null``) and
as the fallback when a prompt cannot be tokenized here.

Each character's code point stands in for a token id and ``char_block_size`` characters make a
block, chained with the same xxh3 scheme as token blocks. The root is the token root's namespace
(model, LoRA adapter, cache salt) with a ``\\x00chars`` suffix, so character keys never equal a
token key the agents report: they only ever match the gateway's own approximate index entries.
Token counts are estimated at ``CHARS_PER_TOKEN`` characters a token.
"""

from __future__ import annotations

import numpy as np
import xxhash

from router_policies.block_keys import chain_keys, namespace_bytes

CHARS_PER_TOKEN = 4


def char_root_key(model: str, lora: str | None = None, cache_salt: str | None = None) -> int:
    return xxhash.xxh3_64_intdigest(b"kvgate:v1:" + namespace_bytes(model, lora, cache_salt) + b"\x00chars")


def char_block_keys(
    text: str, char_block_size: int, model: str, lora: str | None = None, cache_salt: str | None = None
) -> list[int]:
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    return chain_keys(char_root_key(model, lora, cache_salt), codes, char_block_size)


def estimated_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)
