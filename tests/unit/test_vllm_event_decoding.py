"""Decoding engine KV events: recorded bytes of a real vLLM (tests/data/vllm_events), the same events
re-encoded as tagged arrays (older vLLM), SGLang's shape (signed hashes, partial pages), digests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from replica_agent.engine_events import (
    BASE_STORED_FIELDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedEvent,
    decode_payload,
)
from replica_agent.inventory import AgentInventory
from router_policies.block_keys import block_keys, chain_keys, root_key

DATA = Path(__file__).resolve().parent.parent / "data" / "vllm_events"
CAPTURES = sorted(p for p in DATA.glob("*.json") if not p.name.startswith("hybrid_"))
HYBRID = sorted(DATA.glob("hybrid_*.json"))  # hybrid-attention models: several KV-cache groups


def _stored_map(hashes: list[Any], parent: Any, tokens: list[int], **fields: Any) -> dict[str, Any]:
    """A vLLM BlockStored in map form: block size 2, GPU, no LoRA, unless ``fields`` say otherwise."""
    base = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens}
    return {**base, "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, **fields}


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _frames(capture: dict[str, Any]) -> list[tuple[int, bytes]]:
    """Every recorded (seq, payload) of the capture, in seq order, without the replay end marker."""
    seen: dict[int, bytes] = {}
    sources: list[Any] = [capture.get("frames", [])]
    sources += [r.get("frames") for r in capture.get("requests", []) if isinstance(r.get("frames"), list)]
    sources.append(capture.get("replay", {}).get("from_0", []))
    for frames in sources:
        for f in frames or []:
            if isinstance(f, dict) and f["seq"] >= 0 and f.get("payload_hex"):
                seen.setdefault(f["seq"], bytes.fromhex(f["payload_hex"]))
    return sorted(seen.items())


def _to_tagged(payload: bytes) -> bytes:
    """The same batch in the older tagged-array encoding ([ts, events, rank], events as arrays)."""
    obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    ts, events = (obj[0], obj[1]) if isinstance(obj, list) else (obj["ts"], obj["events"])
    out = []
    for e in events:
        if e["type"] == "BlockStored":
            out.append(["BlockStored", *(e.get(k) for k in BASE_STORED_FIELDS)])
        elif e["type"] == "BlockRemoved":
            out.append(["BlockRemoved", e["block_hashes"], e.get("medium")])
        else:
            out.append([e["type"]])
    return bytes(msgpack.packb([ts, out, 0]))


needs_capture = pytest.mark.skipif(not CAPTURES, reason="no recorded vLLM events in tests/data/vllm_events")


@needs_capture
@pytest.mark.parametrize("path", CAPTURES, ids=[p.name for p in CAPTURES])
def test_real_vllm_bytes_decode(path: Path) -> None:
    capture = _load(path)
    frames = _frames(capture)
    assert frames, "the capture holds no event frames"
    kinds: set[str] = set()
    for _seq, payload in frames:
        batch = decode_payload(payload)
        assert batch.malformed == 0
        assert batch.ts > 1e9  # engine wall clock
        for ev in batch.events:
            kinds.add(type(ev).__name__)
            if isinstance(ev, BlockStored):
                assert ev.block_size == capture["block_size"]
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                assert ev.medium == "GPU"
                for h in ev.block_hashes:
                    assert isinstance(h, int | bytes)
                    if isinstance(h, int):
                        assert 0 <= h < 2**64  # unsigned
    assert {"BlockStored", "BlockRemoved"} <= kinds


@needs_capture
@pytest.mark.parametrize("path", CAPTURES, ids=[p.name for p in CAPTURES])
def test_real_vllm_keys_equal_gateway_keys(path: Path) -> None:
    """The agent's keys of the real engine's first stored blocks equal the keys the gateway computes
    from /tokenize of the same prompt."""
    capture = _load(path)
    model, bs = capture["model"], capture["block_size"]
    frames = _frames(capture)
    inv = AgentInventory(model, bs, max_blocks=100_000)
    inv.apply(decode_payload(frames[0][1]).events)
    first = decode_payload(frames[0][1]).events[0]
    assert isinstance(first, BlockStored) and first.parent is None
    prompts = {
        t["request"].get("prompt"): t["response"]["tokens"]
        for t in capture["tokenize"]
        if "prompt" in t["request"]
    }
    matching = [toks for toks in prompts.values() if toks[: len(first.token_ids)] == first.token_ids]
    assert matching, "no tokenized prompt starts with the first stored block's tokens"
    expected = block_keys(matching[0], bs, model)[: len(first.block_hashes)]
    assert expected == chain_keys(root_key(model), first.token_ids, bs)
    assert set(expected) <= set(inv.keys())


@needs_capture
@pytest.mark.parametrize("path", CAPTURES, ids=[p.name for p in CAPTURES])
def test_map_and_tagged_encodings_give_the_same_inventory(path: Path) -> None:
    capture = _load(path)
    frames = _frames(capture)
    by_map = AgentInventory(capture["model"], capture["block_size"], max_blocks=100_000)
    by_array = AgentInventory(capture["model"], capture["block_size"], max_blocks=100_000)
    sizes = []
    for _seq, payload in frames:
        by_map.apply(decode_payload(payload).events)
        by_array.apply(decode_payload(_to_tagged(payload)).events)
        assert by_map.snapshot() == by_array.snapshot()
        sizes.append(len(by_map))
    assert max(sizes) > 0
    assert by_map.stats.skipped_blocks == 0
    for i, (_s, p) in enumerate(frames):
        if any(isinstance(e, AllBlocksCleared) for e in decode_payload(p).events):
            assert sizes[i] == 0  # the prefix-cache reset empties the inventory


def test_map_payload_shape() -> None:
    """A msgspec EventBatch without array_like is a map: accept it too."""
    ev = _stored_map([2**64 - 1], None, [1, 2])
    batch = decode_payload(
        msgpack.packb({"ts": 5.0, "events": [ev, {"type": "AllBlocksCleared"}], "data_parallel_rank": 0})
    )
    assert batch.ts == 5.0
    stored, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [2**64 - 1]
    assert isinstance(cleared, AllBlocksCleared)


def test_sglang_events_signed_hashes_and_partial_page() -> None:
    """SGLang: [ts, events] arrays, tagged events without medium, signed 64-bit hashes, one event
    per page; the last page can be partial and is not keyed."""
    bs = 4
    pages = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    hashes = [-(2**63), -5, 7]
    events: list[Any] = []
    parent = None
    for h, toks in zip(hashes, pages, strict=True):
        events.append(["BlockStored", [h], parent, toks, bs, None])
        parent = h
    payload = msgpack.packb([1.5, events])
    batch = decode_payload(payload)
    assert [type(e) for e in batch.events] == [BlockStored] * 3
    inv = AgentInventory("m", bs, max_blocks=100)
    inv.apply(batch.events)
    assert sorted(inv.keys()) == sorted(block_keys([1, 2, 3, 4, 5, 6, 7, 8], bs, "m"))
    inv.apply(decode_payload(msgpack.packb([2.0, [["BlockRemoved", [-5]]]])).events)
    assert inv.keys() == block_keys([1, 2, 3, 4], bs, "m")


def test_digest_hashes() -> None:
    h1, h2 = bytes(range(32)), bytes(range(1, 33))
    events = [
        _stored_map([h1], None, [1, 2]),
        _stored_map([h2], h1, [3, 4]),
        {"type": "BlockRemoved", "block_hashes": [h2], "medium": "GPU"},
    ]
    batch = decode_payload(msgpack.packb([1.0, events, 0], use_bin_type=True))
    assert isinstance(batch.events[0], BlockStored) and batch.events[0].block_hashes == [h1]
    inv = AgentInventory("m", 2, max_blocks=10)
    inv.apply(batch.events[:2])
    assert sorted(inv.keys()) == sorted(block_keys([1, 2, 3, 4], 2, "m"))
    inv.apply(batch.events[2:])
    assert inv.keys() == block_keys([1, 2], 2, "m")
    assert isinstance(batch.events[2], BlockRemoved)


def test_lora_and_cache_salt_namespace() -> None:
    """vLLM's extra_keys of a first block: (lora_name, *mm, cache_salt); the agent's root must be the
    gateway's root for (model, lora, salt)."""
    lora = {"lora_id": 7, "lora_name": "sql-adapter"}
    ev = _stored_map(
        [1, 2], None, [1, 2, 3, 4], **lora, extra_keys=[["sql-adapter", "tenant-a"], ["sql-adapter"]]
    )
    child = _stored_map([3], 2, [5, 6], **lora, extra_keys=[["sql-adapter"]])
    inv = AgentInventory("m", 2, max_blocks=10)
    inv.apply(decode_payload(msgpack.packb([1.0, [ev, child], 0])).events)
    assert sorted(inv.keys()) == sorted(
        block_keys([1, 2, 3, 4, 5, 6], 2, "m", lora="sql-adapter", cache_salt="tenant-a")
    )
    salt_only = dict(ev, lora_name=None, lora_id=None, extra_keys=[["tenant-b"], None], block_hashes=[10, 11])
    inv2 = AgentInventory("m", 2, max_blocks=10)
    inv2.apply(decode_payload(msgpack.packb([1.0, [salt_only], 0])).events)
    assert sorted(inv2.keys()) == sorted(block_keys([1, 2, 3, 4], 2, "m", cache_salt="tenant-b"))


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgpack.packb("hello"),
        msgpack.packb([1.0]),
        msgpack.packb([1.0, "x"]),
        msgpack.packb({"ts": 1}),
    ],
)
def test_malformed_payloads_raise(payload: bytes) -> None:
    with pytest.raises(MalformedEvent):
        decode_payload(payload)


def test_malformed_events_are_counted_and_skipped() -> None:
    good = ["AllBlocksCleared"]
    bad: list[Any] = [
        ["BlockStored", "nope", None, [1], 1, None],
        {
            "type": "BlockStored",
            "block_hashes": [1.5],
            "parent_block_hash": None,
            "token_ids": [1],
            "block_size": 1,
        },
        {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [1],
            "block_size": 0,
        },
        {"type": "Mystery"},
        42,
        [],
    ]
    batch = decode_payload(msgpack.packb([1.0, [*bad, good], 0]))
    assert batch.malformed == len(bad)
    assert [type(e) for e in batch.events] == [AllBlocksCleared]


def _deepest_reusable(keys: list[int], reusable: set[int], max_blocks: int) -> int:
    """vLLM's hybrid prefix hit in blocks: the deepest key of the request that the engine can
    reuse, among the first ``max_blocks`` (HybridKVCacheCoordinator.find_longest_cache_hit)."""
    for j in range(min(max_blocks, len(keys)) - 1, -1, -1):
        if keys[j] in reusable:
            return j + 1
    return 0


@pytest.mark.skipif(not HYBRID, reason="no recorded hybrid-model events")
@pytest.mark.parametrize("path", HYBRID, ids=[p.name for p in HYBRID])
def test_hybrid_model_inventory_predicts_the_engines_cached_tokens(path: Path) -> None:
    """A real vLLM serving a Gemma-3 model (a sliding-window group and a full-attention group):
    before each request, the agent's reusable keys give exactly the cached tokens the engine then
    reported, hits and misses alike; the events carry both groups, the window group's stores
    list fewer hashes than blocks, and blocks are stored (and removed) more than once."""
    capture = _load(path)
    model, bs = capture["model"], capture["block_size"]
    payloads = [bytes.fromhex(f["payload_hex"]) for f in capture["frames"]]
    kinds = {
        (ev.group, ev.spec_kind, ev.window)
        for p in payloads
        for ev in decode_payload(p).events
        if isinstance(ev, BlockStored)
    }
    assert {k[1] for k in kinds} == {"full_attention", "sliding_window"}
    inv = AgentInventory(model, bs, max_blocks=100_000)
    applied = 0
    hits = 0
    for req, tok in zip(capture["requests"], capture["tokenize"], strict=True):
        start, _end = req["frames"]
        for p in payloads[applied:start]:
            inv.apply(decode_payload(p).events)
        applied = start
        tokens = tok["response"]["tokens"]
        predicted = _deepest_reusable(block_keys(tokens, bs, model), set(inv.keys()), (len(tokens) - 1) // bs)
        assert predicted * bs == req["cached_tokens"], (
            req.get("tag") or req["request"].get("prompt", "chat")[:40]
        )
        hits += predicted > 0
    for p in payloads[applied:]:
        inv.apply(decode_payload(p).events)
    assert hits >= 2 and inv.hybrid
    assert inv.stats.unknown_removals == 0 and inv.stats.skipped_blocks == 0
    if "reset_prefix_cache" in capture:
        assert len(inv) == 0  # the capture ends with a prefix-cache reset


@pytest.mark.skipif(not HYBRID, reason="no recorded hybrid-model events")
def test_hybrid_group_fields_decode() -> None:
    capture = _load(HYBRID[0])
    removed_groups = set()
    for f in capture["frames"]:
        for ev in decode_payload(bytes.fromhex(f["payload_hex"])).events:
            if isinstance(ev, BlockStored):
                assert ev.group in (0, 1)
                assert (ev.spec_kind, ev.window) in {("sliding_window", 64), ("full_attention", None)}
                assert len(ev.block_hashes) <= len(ev.token_ids) // ev.block_size
            elif isinstance(ev, BlockRemoved):
                removed_groups.add(ev.group)
    assert removed_groups == {0, 1}
