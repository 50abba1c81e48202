"""The parts of ``kvgate serve --workers N`` that need no process (docs/architecture.md,
"Workers"): the worker count, the channel's frames, the merged metrics, the replay of speculative
entries into a worker's index copy."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.local_hub_client import _replay_speculative
from gateway.local_hub_codec import (
    decode_replica,
    decode_stamps,
    decode_touch,
    encode_replica,
    encode_stamps,
    encode_touch,
    frame,
    read_frame,
)
from gateway.local_hub_touch import Touch, TouchBatcher
from gateway.shared_state_codec import CodecError
from gateway.workers import usable_cores
from gateway.workers_metrics import merge_expositions
from router_policies.prefix_index import IndexConfig, PrefixIndex


def test_usable_cores_follows_the_cgroup_quota(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a core: one worker
    assert usable_cores(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{100000 * affinity + 1} 100000\n")  # above the affinity
    assert usable_cores(tmp_path) == affinity
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(v1) == affinity
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert usable_cores(v1) == 1
    assert usable_cores(tmp_path / "absent") == affinity


def test_frames_round_trip_and_refuse_what_does_not_decode() -> None:
    replica, keys, lifetime = decode_touch(encode_touch("r-é", [1, 2**64 - 1], 2.5)[5:])
    assert (replica, keys, lifetime) == ("r-é", [1, 2**64 - 1], 2.5)
    replica, keys, stamps = decode_stamps(encode_stamps("r1", [(7, 10.5), (8, 11.0)])[5:])
    assert (replica, keys, stamps) == ("r1", [7, 8], [10.5, 11.0])
    assert decode_replica(encode_replica(b"S", "x", b"payload")[5:]) == ("x", b"payload")
    for bad in (b"", b"\x05\x00ab", encode_touch("r", [1], 1.0)[5:-3]):
        with pytest.raises(CodecError):
            decode_touch(bad)

    async def read(data: bytes, bound: int) -> tuple[bytes, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader, bound)

    assert asyncio.run(read(frame(b"Y") + frame(b"Q"), 16)) == (b"Y", b"")
    with pytest.raises(CodecError):
        asyncio.run(read(frame(b"S", b"x" * 100), 16))  # over the bound: refused before reading it
    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(read(frame(b"S", b"xyz")[:-1], 16))


def _exposition(requests: float, up: float) -> bytes:
    registry = CollectorRegistry()
    Counter("kvgate_requests", "Requests.", ["replica"], registry=registry).labels("r0").inc(requests)
    Gauge("kvgate_up", "Up.", registry=registry).set(up)
    return generate_latest(registry)


def test_merged_metrics_label_every_sample_with_its_worker() -> None:
    text = merge_expositions(
        {"0": _exposition(3, 1), "1": _exposition(4, 1), "parent": _exposition(0, 0)}
    ).decode()
    assert text.count("# TYPE kvgate_requests_total counter") == 1
    assert text.count("# HELP kvgate_up Up.") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    by_worker = {
        s.labels["worker"]: s.value for s in families["kvgate_requests"].samples if s.name.endswith("_total")
    }
    assert by_worker == {"0": 3.0, "1": 4.0, "parent": 0.0}
    assert all(s.labels["replica"] == "r0" for s in families["kvgate_requests"].samples)
    assert {s.labels["worker"]: s.value for s in families["kvgate_up"].samples} == {
        "0": 1,
        "1": 1,
        "parent": 0,
    }


def test_speculative_entries_replay_in_the_same_eviction_order() -> None:
    config = IndexConfig(approximate_ttl_s=60, approximate_blocks_per_replica=100)
    source, copy = PrefixIndex(config), PrefixIndex(config)
    for index in (source, copy):
        index.add_replica("r")
    source.touch_approximate("r", [1, 2, 3], 100.0)
    source.touch_approximate("r", [1, 2, 4, 5], 101.0, lifetime_s=10.0)
    source.touch_approximate("r", [9], 102.0)
    entries = source.approximate_expiry("r")
    _replay_speculative(copy, "r", [k for k, _ in entries], [t for _, t in entries])
    assert copy.approximate_expiry("r") == entries
    assert copy.match([1, 2, 4, 5]).blocks == source.match([1, 2, 4, 5]).blocks


def test_a_batch_of_relayed_touches_orders_entries_as_one_touch_each_would() -> None:
    config = IndexConfig(approximate_ttl_s=60, approximate_blocks_per_replica=100)
    one_by_one, batched = PrefixIndex(config), PrefixIndex(config)
    for index in (one_by_one, batched):
        index.add_replica("r")
    chains = [[1, 2, 3], [1, 2, 4, 5], [9], [1, 6]]  # prompts sharing blocks 1 and 2
    for chain in chains:
        one_by_one.touch_approximate("r", chain, 100.0, 10.0)
    applied: list[list[Touch]] = []
    batcher = TouchBatcher(batched, lambda r: r == "r", applied.append)

    async def relay() -> None:
        for chain in chains:
            batcher.add(Touch("r", chain, 10.0))
        batcher.add(Touch("gone", [7], 10.0))  # a replica this process does not know: skipped
        await asyncio.sleep(0)  # the end of the event loop's turn applies the batch

    asyncio.run(relay())
    assert batched.approximate_keys("r") == one_by_one.approximate_keys("r")
    assert [len(b) for b in applied] == [5]
    assert batched.match([1, 2, 4, 5]).blocks == {"r": 4}
