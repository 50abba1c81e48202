"""The agent's decoder and subscriber on bytes SGLang's own code published (tests/data/sglang_events,
recorded by scripts/record_sglang_events.py from SGLang 0.5.10, 0.5.19 and 0.5.23's RadixCache and
ZmqEventPublisher): the inventory's keys equal the keys computed from the token ids the radix cache
holds at the end, in their LoRA and cache-salt namespaces, at page size 1 and 16, from the live
frames and from the replay ROUTER's frames."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from replica_agent.engine_events import BlockStored, decode_payload
from replica_agent.inventory import AgentInventory
from replica_agent.subscriber import EventSubscriber
from router_policies.block_keys import block_keys

DATA = Path(__file__).resolve().parent.parent / "data" / "sglang_events"
RECORDINGS = sorted(p.relative_to(DATA).as_posix() for p in DATA.glob("*/page*"))
GATEWAY_BLOCK = 16


def _load(rec: str) -> tuple[list[list[bytes]], list[list[bytes]], dict[str, Any]]:
    d = DATA / rec
    live = msgpack.unpackb((d / "live.msgpack").read_bytes())
    replay = msgpack.unpackb((d / "replay.msgpack").read_bytes())
    expected = json.loads((d / "expected.json").read_text())
    return live, replay, expected


def _expected_keys(expected: dict[str, Any], block_size: int) -> set[int]:
    keys: set[int] = set()
    for p in expected["paths"]:
        keys.update(block_keys(p["tokens"], block_size, expected["model"], p["lora_name"], p["cache_salt"]))
    return keys


def _inventory(expected: dict[str, Any], key_block_size: int | None) -> AgentInventory:
    # the engine's block size is learnt from the first event, as the agent does without --block-size
    return AgentInventory(expected["model"], None, 100_000, key_block_size=key_block_size)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def test_recordings_cover_every_shape() -> None:
    assert {r.split("/")[0] for r in RECORDINGS} >= {"0.5.10", "0.5.19", "0.5.23"}
    for rec in RECORDINGS:
        _live, _replay, expected = _load(rec)
        namespaces = {(p["lora_name"], p["cache_salt"]) for p in expected["paths"]}
        want: set[tuple[str | None, str | None]] = {(None, None)}
        if expected["salt"]:
            want |= {(None, "tenant-a")}
        if expected["lora"]:
            want |= {("adapter-x", None), ("adapter-x", "tenant-b")}
        assert namespaces == want, rec


@pytest.mark.parametrize("rec", RECORDINGS)
@pytest.mark.parametrize("key_block_size", [None, GATEWAY_BLOCK])
async def test_live_frames_key_as_the_token_ids(
    ctx: zmq.asyncio.Context, rec: str, key_block_size: int | None
) -> None:
    live, _replay, expected = _load(rec)
    inv = _inventory(expected, key_block_size)
    sub = EventSubscriber(ctx, "tcp://127.0.0.1:9", None, inv)
    for frames in live:
        await sub.handle_frames(frames)
    assert sub.stats.batches_applied == len(live)
    assert sub.stats.malformed_frames == sub.stats.malformed_events == sub.stats.gaps == 0
    assert inv.block_size == expected["page_size"]
    assert inv.stats.skipped_blocks == 0 and not inv.degraded
    want = _expected_keys(expected, key_block_size or expected["page_size"])
    assert want and set(inv.keys()) == want


@pytest.mark.parametrize("rec", RECORDINGS)
async def test_replay_frames_rebuild_the_same_inventory(ctx: zmq.asyncio.Context, rec: str) -> None:
    """The engine's replay ROUTER frames, served byte for byte to the subscriber's catch-up."""
    live, replay, expected = _load(rec)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        ident, _empty, start = await router.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        for frames in replay:
            await router.send_multipart([ident, *frames])

    server = asyncio.create_task(serve())
    inv = _inventory(expected, GATEWAY_BLOCK)
    sub = EventSubscriber(ctx, "tcp://127.0.0.1:9", f"tcp://127.0.0.1:{port}", inv, replay_timeout_s=5.0)
    await sub.catch_up()
    await server
    router.close(linger=0)
    assert sub.stats.replayed_batches == len(live) and sub.expected == len(live)
    assert sub.stats.malformed_frames == 0 and not inv.degraded
    assert set(inv.keys()) == _expected_keys(expected, GATEWAY_BLOCK)
    # newer SGLang sends the topic in replay frames, older ones do not: both were recorded
    lengths = {len(f) for f in replay}
    assert lengths == ({4} if rec.startswith("0.5.23") else {3})


def _stored(rec: str) -> list[BlockStored]:
    live, _replay, _expected = _load(rec)
    out: list[BlockStored] = []
    for frames in live:
        out.extend(e for e in decode_payload(frames[2]).events if isinstance(e, BlockStored))
    return out


def test_metadata_map_is_the_salt_not_a_lora_name() -> None:
    """0.5.19's BlockStoredWithMetadata puts {"cache_salt": ...} where vLLM's array has lora_name."""
    salted = [e for e in _stored("0.5.19/page16") if e.cache_salt is not None]
    assert salted and {e.cache_salt for e in salted} == {"tenant-a"}
    assert all(e.lora_name is None for e in _stored("0.5.19/page16"))


def test_salt_and_lora_fields_of_map_events() -> None:
    roots = [e for e in _stored("0.5.23/page1") if e.parent is None]
    assert {(e.lora_name, e.cache_salt) for e in roots} == {
        (None, None),
        (None, "tenant-a"),
        ("adapter-x", None),
        ("adapter-x", "tenant-b"),
    }
