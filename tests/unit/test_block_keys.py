"""The block-key contract (docs/architecture.md, "Block keys"), checked against an independent per-token
implementation and by property tests."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from router_policies.block_keys import block_keys, chain_keys, namespace_bytes, root_key, token_bytes

tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)
block_size_st = st.integers(min_value=1, max_value=16)


def reference_keys(tokens: list[int], block_size: int, namespace: bytes) -> list[int]:
    """The §3 formula written out literally, one token at a time."""
    prev = xxhash.xxh3_64_intdigest(b"kvgate:v1:" + namespace)
    out = []
    for b in range(len(tokens) // block_size):
        data = prev.to_bytes(8, "little")
        for t in tokens[b * block_size : (b + 1) * block_size]:
            data += struct.pack("<I", t)
        prev = xxhash.xxh3_64_intdigest(data)
        out.append(prev)
    return out


@given(tokens_st, block_size_st)
def test_matches_the_literal_formula(tokens: list[int], bs: int) -> None:
    assert block_keys(tokens, bs, "m") == reference_keys(tokens, bs, b"m")


@given(tokens_st, block_size_st)
def test_partial_blocks_are_never_keyed(tokens: list[int], bs: int) -> None:
    keys = block_keys(tokens, bs, "m")
    assert len(keys) == len(tokens) // bs
    # adding a partial tail changes nothing
    assert block_keys([*tokens, *([7] * (bs - 1))], bs, "m")[: len(keys)] == keys
    assert len(block_keys([*tokens[: len(keys) * bs], *([7] * (bs - 1))], bs, "m")) == len(keys)


@given(tokens_st, tokens_st, block_size_st)
def test_equal_prefixes_give_equal_keys(a: list[int], b: list[int], bs: int) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ka, kb = block_keys(a, bs, "m"), block_keys(b, bs, "m")
    shared_blocks = common // bs
    assert ka[:shared_blocks] == kb[:shared_blocks]


@given(
    st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=120),
    block_size_st,
    st.data(),
)
def test_a_differing_token_changes_every_later_key(tokens: list[int], bs: int, data: st.DataObject) -> None:
    if len(tokens) < bs:
        return
    pos = data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))
    other = list(tokens)
    other[pos] = (other[pos] + 1) % 2**32
    ka, kb = block_keys(tokens, bs, "m"), block_keys(other, bs, "m")
    first = pos // bs
    assert ka[:first] == kb[:first]
    assert all(x != y for x, y in zip(ka[first:], kb[first:], strict=True))


@settings(max_examples=50)
@given(
    st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=4, max_size=64),
    st.sampled_from(
        [
            ("m2", None, None),
            ("m", "adapter", None),
            ("m", None, "salt"),
            ("m", "adapter", "salt"),
        ]
    ),
)
def test_any_namespace_change_changes_every_key(
    tokens: list[int], ns: tuple[str, str | None, str | None]
) -> None:
    base = block_keys(tokens, 4, "m")
    other = block_keys(tokens, 4, *ns)
    assert all(x != y for x, y in zip(base, other, strict=True))


def test_namespaces_are_distinct() -> None:
    triples = [("m", None, None), ("m", "a", None), ("m", None, "a"), ("m", "a", "a"), ("ma", None, None)]
    roots = {root_key(*t) for t in triples}
    assert len(roots) == len(triples)
    assert namespace_bytes("m", "", "") == b"m"  # empty adapter/salt mean "none"


def test_chain_keys_continues_a_chain() -> None:
    tokens = list(range(64))
    whole = block_keys(tokens, 16, "m")
    head = block_keys(tokens[:32], 16, "m")
    assert head + chain_keys(head[-1], tokens[32:], 16) == whole


def test_known_vector() -> None:
    # pins the wire contract: an agent built from another code base must produce these numbers
    assert root_key("m") == xxhash.xxh3_64_intdigest(b"kvgate:v1:m")
    keys = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "m")
    assert keys == reference_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, b"m")
    assert len(keys) == 2


@given(tokens_st)
def test_uint32_arrays_give_the_bytes_of_the_list_even_as_views(tokens: list[int]) -> None:
    """The gateway's token arrays (uint32) take the path without a range check; strided views
    and big-endian arrays included, their bytes are the list's little-endian ones."""
    arr = np.asarray(tokens, dtype=np.uint32)
    assert token_bytes(arr) == token_bytes(tokens)
    assert token_bytes(arr[::2]) == token_bytes(tokens[::2])
    assert token_bytes(arr.astype(">u4")) == token_bytes(tokens)


def test_numpy_input_and_bounds() -> None:
    arr = np.arange(48, dtype=np.int64)
    assert block_keys(arr, 16, "m") == block_keys(list(range(48)), 16, "m")
    with pytest.raises(ValueError):
        token_bytes([-1])
    with pytest.raises(ValueError):
        token_bytes([2**32])
    with pytest.raises(ValueError):
        chain_keys(0, [1], 0)


def test_32k_prompt_is_keyed_per_block_not_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # The Python-level work is one xxh3 call per block: count the calls instead of timing them.
    import router_policies.block_keys as bk

    calls = 0
    real = bk._xxh3

    def counting(data: bytes) -> int:
        nonlocal calls
        calls += 1
        return real(data)

    monkeypatch.setattr(bk, "_xxh3", counting)
    tokens = np.arange(32768) % 50000
    keys = block_keys(tokens, 16, "m")
    assert len(keys) == 2048
    assert calls == 2048 + 1  # the blocks, plus the namespace root
    monkeypatch.undo()
    assert keys == reference_keys(tokens.tolist(), 16, b"m")
