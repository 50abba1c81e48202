"""``kvgate sim-engine``'s KV events on a real ZMQ SUB and replay DEALER: vLLM's framing and event
maps, the held set they reproduce (equal to /debug/blocks through evictions), replay and its
bound, the fault switch, AllBlocksCleared, and seq restarting with the engine."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from replica_agent.engine_events import BASE_STORED_FIELDS
from tests.integration.test_sim_engine_harness import (
    Batch,
    Engine,
    Rekeyer,
    Subscriber,
    engines,
    get,
    launch,
    post,
    replay,
    tokens_for,
    wait_for,
    warm_up,
)

__all__ = ["engines", "launch"]

MODEL = "sim-model"
STORED_KEYS = {"type", *BASE_STORED_FIELDS}  # the map form of vLLM's BlockStored


def complete(e: Engine, prompt: list[int], max_tokens: int = 2) -> dict[str, Any]:
    status, body = post(e.http + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
    assert status == 200, body
    return dict(body)


def held(e: Engine) -> list[int]:
    status, body = get(e.http + "/debug/blocks")
    assert status == 200
    return list(body["keys"])


def state(e: Engine) -> dict[str, Any]:
    return dict(get(e.http + "/debug/state")[1])


def all_batches(e: Engine) -> list[Batch]:
    assert e.replay is not None
    return replay(e.replay, 0)


def mixed_workload(e: Engine, n: int = 40) -> None:
    """Shared-prefix groups, distinct tails and lengths, some requests concurrent: evicts."""
    prompts = [tokens_for(i % 9, 40 + (i * 13) % 70, shared=32 if i % 3 else 0) for i in range(n)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda p: complete(e, p, 3), prompts))


def test_events_reproduce_held_blocks_through_evictions(launch: Any) -> None:
    e = launch(model=MODEL, block_size=16, cache_blocks=24)
    sub = Subscriber(e.events)
    try:
        live = warm_up(e, sub, 16)
        mixed_workload(e)
        live += sub.drain()
    finally:
        sub.close()
    batches = all_batches(e)
    assert [b.seq for b in batches] == list(range(len(batches)))  # seq from 0, no gap
    by_seq = {b.seq: b for b in batches}
    assert live and all(b.payload == by_seq[b.seq].payload and b.topic == b"" for b in live)

    rk = Rekeyer(MODEL, 16)
    kinds: dict[str, int] = {}
    hashes: list[int] = []
    for b in batches:
        assert b.dp_rank == 0 and isinstance(b.ts, float) and b.events
        for ev in b.events:
            kinds[ev["type"]] = kinds.get(ev["type"], 0) + 1
            if ev["type"] == "BlockStored":
                assert set(ev) == STORED_KEYS
                assert ev["medium"] == "GPU" and ev["block_size"] == 16 and ev["lora_id"] is None
                hashes += ev["block_hashes"]
            else:
                assert ev["type"] == "BlockRemoved" and set(ev) == {"type", "block_hashes", "medium"}
                assert len(ev["block_hashes"]) == 1  # vLLM: one hash per BlockRemoved
            rk.apply(ev)
    assert kinds.get("BlockRemoved", 0) > 0, "the workload must evict"
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
    assert any(h >= 2**63 for h in hashes)  # unsigned: decoders must not assume int64
    keys = held(e)
    assert keys and rk.keys() == keys
    assert not set(keys) & set(hashes)  # the engine's hashes are not kvgate keys
    st = state(e)
    # The hash map is bounded: at rest it holds exactly the cached blocks, at most the cache.
    assert st["registry_entries"] == st["held_blocks"] == len(keys) <= 24


def test_bytes_hashes_array_encoding_and_topic(launch: Any) -> None:
    e = launch(
        model=MODEL,
        block_size=16,
        cache_blocks=12,
        hash_format="bytes",
        event_encoding="array",
        topic="kv-events",
    )
    mixed_workload(e, 15)
    batches = all_batches(e)
    rk = Rekeyer(MODEL, 16)
    removed = 0
    for b in batches:
        assert b.topic == b"kv-events"
        for ev in b.events:
            assert isinstance(ev, list) and ev[0] in ("BlockStored", "BlockRemoved")
            assert all(isinstance(h, bytes) and len(h) == 32 for h in ev[1])
            if ev[0] == "BlockStored":
                assert len(ev) == 7 and ev[6] == "GPU"
            else:
                removed += 1
            rk.apply(ev)
    assert removed > 0
    assert rk.keys() == held(e)


def test_replay_buffer_is_bounded(launch: Any) -> None:
    e = launch(replay_buffer=3, block_size=16)
    for i in range(6):
        complete(e, tokens_for(i, 20), 1)  # one new block each: one batch each
    st = wait_for(lambda: (s := state(e))["next_seq"] == 6 and s, what="six batches")
    assert st["replay_buffered"] == 3
    assert [b.seq for b in all_batches(e)] == [3, 4, 5]
    assert [b.seq for b in replay(e.replay, 5)] == [5]
    assert replay(e.replay, 6) == []


def _faults(e: Engine, **body: Any) -> dict[str, Any]:
    status, r = post(e.http + "/debug/faults", body)
    assert status == 200, r
    return dict(r)


def test_fault_switch_drop_duplicate_reorder(launch: Any) -> None:
    e = launch(block_size=16)
    sub = Subscriber(e.events)
    try:
        warm_up(e, sub, 16)
        n = 0

        def one_batch() -> None:
            nonlocal n
            n += 1
            complete(e, tokens_for(500 + n, 20), 1)

        # drop 2: a gap on the SUB, recovered by replay with the same bytes.
        start = _faults(e, drop=2)["next_seq"]
        for _ in range(3):
            one_batch()
        got = sub.drain()
        assert [b.seq for b in got] == [start + 2]
        rep = replay(e.replay, start)
        assert [b.seq for b in rep] == [start, start + 1, start + 2]
        assert rep[2].payload == got[0].payload

        # drop 1 from the replay buffer too: the gap cannot be recovered.
        start = _faults(e, drop=1, from_replay=True)["next_seq"]
        one_batch()
        one_batch()
        assert [b.seq for b in sub.drain()] == [start + 1]
        assert [b.seq for b in replay(e.replay, start)] == [start + 1]

        # duplicate 1: the same batch twice.
        start = _faults(e, duplicate=1)["next_seq"]
        one_batch()
        got = sub.drain()
        assert [b.seq for b in got] == [start, start]
        assert got[0].payload == got[1].payload

        # reorder 1: held back and sent after the next batch.
        start = _faults(e, reorder=1)["next_seq"]
        one_batch()
        one_batch()
        assert [b.seq for b in sub.drain()] == [start + 1, start]

        status, left = get(e.http + "/debug/faults")
        assert status == 200
        assert left.pop("requests")["applied"] == {
            k: 0 for k in ("error", "hang", "slow", "corrupt", "stall")
        }
        assert left == {"drop": 0, "from_replay": False, "duplicate": 0, "reorder": 0, "next_seq": start + 2}
        one_batch()
        assert [b.seq for b in sub.drain()] == [start + 2]
    finally:
        sub.close()


def test_reset_prefix_cache_publishes_all_blocks_cleared(launch: Any) -> None:
    e = launch(model=MODEL, block_size=16)
    sub = Subscriber(e.events)
    try:
        warm_up(e, sub, 16)
        complete(e, tokens_for(1, 50))
        sub.drain()
        assert held(e)
        status, _ = post(e.http + "/reset_prefix_cache", {})
        assert status == 200
        assert held(e) == []
        # As in vLLM, AllBlocksCleared goes out with the next engine step.
        complete(e, tokens_for(2, 40))
        got = sub.drain()
        assert got[0].events[0] == {"type": "AllBlocksCleared"}
    finally:
        sub.close()
    rk = Rekeyer(MODEL, 16)
    for b in all_batches(e):
        for ev in b.events:
            rk.apply(ev)
    assert rk.keys() == held(e) and len(held(e)) == 2


def test_restart_resets_seq_and_cache(launch: Any) -> None:
    e1 = launch(model=MODEL, block_size=16)
    sub = Subscriber(e1.events)
    try:
        warm_up(e1, sub, 16)
        for i in range(5):
            complete(e1, tokens_for(i, 20), 1)
        last_before = sub.drain()[-1].seq
        assert last_before >= 5
        assert e1.stop() == 0  # SIGTERM: a clean exit
        e2 = launch(
            model=MODEL,
            block_size=16,
            port=e1.http_port,
            events_port=e1.events_port,
            replay_port=e1.replay_port,
        )
        assert held(e2) == []
        # The same SUB socket reconnects by itself; the new engine counts from 0 again.
        first_after = warm_up(e2, sub, 16)[0].seq
        assert first_after < last_before
    finally:
        sub.close()
    assert all_batches(e2)[0].seq == 0


def test_preemption_under_kv_pressure_completes_and_events_stay_exact(launch: Any) -> None:
    # 4 requests of 40 prompt + 60 output tokens need 7 blocks each; the cache has 12, so decode
    # runs out of blocks and the replica model preempts (recompute), as vLLM does.
    e = launch(model=MODEL, block_size=16, cache_blocks=12)
    prompts = [tokens_for(i, 40) for i in range(4)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda p: complete(e, p, 60), prompts))
    assert all(r["usage"]["completion_tokens"] == 60 for r in results)
    _, text = get(e.http + "/metrics")
    preemptions = next(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_preemptions_total{")
    )
    assert preemptions > 0
    rk = Rekeyer(MODEL, 16)
    for b in all_batches(e):
        for ev in b.events:
            rk.apply(ev)
    assert rk.keys() == held(e)
    st = state(e)
    assert st["registry_entries"] == st["held_blocks"] <= 12 and st["pending"] == 0
