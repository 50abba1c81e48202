"""Ingest benchmark: KV block events applied per second on one core (not a test; prints figures).

    python bench/ingest.py [--batches 20000] [--blocks-per-store 8] [--block-size 16] [--profile STAGE]

A synthetic engine in steady state: every batch stores a chain of ``--blocks-per-store`` new blocks
under one of a few shared prefixes and removes as many old blocks (one BlockRemoved per block, as
vLLM sends them), as vLLM map-encoded msgpack with unsigned 64-bit hashes. A "block event" is one
block stored or removed. Stages, each timed alone on the same events:

  decode            msgpack payload -> event objects (replica_agent.engine_events)
  decode+rekey      ... -> kvgate keys through the agent's inventory (chain_keys, hash map)
  agent total       ... -> protobuf Events messages, as the agent queues them for the gateway
  gateway apply     AgentMessage bytes -> parse -> PrefixIndex (the inventory server's handler),
                    one message per engine batch; "x8": eight engine batches per message
  index apply       pre-keyed store/remove calls on PrefixIndex alone
  agent+index       decode + rekey + index apply in one process (no gRPC): the whole ingest path

``--profile STAGE`` runs one stage under cProfile and prints the top functions.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import random
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgpack
from prometheus_client import CollectorRegistry

from gateway.inventory_server import InventoryServer, InventorySettings
from gateway.inventory_sink import AgentEngine, AgentHello, AgentLoad
from gateway.inventory_stream import StreamState
from proto.kvgate.v1 import inventory_pb2 as pb
from replica_agent.engine_events import decode_payload
from replica_agent.inventory import AgentInventory
from replica_agent.outbox import Outbox
from router_policies.placement import SPECULATIVE_TTL_S
from router_policies.prefix_index import IndexConfig, PrefixIndex

MODEL = "bench-model"


def make_payloads(batches: int, per_store: int, block_size: int, seed: int) -> tuple[list[bytes], int]:
    """Engine payloads and the number of block events they carry."""
    rng = random.Random(seed)
    prefixes: list[int | None] = [None]
    live: list[int] = []
    payloads: list[bytes] = []
    events_total = 0
    next_hash = 2**63 + 1  # above 2**63, as vLLM's unsigned hashes often are
    ts = 1.7e9
    for _ in range(batches):
        events: list[dict[str, Any]] = []
        # evict the oldest blocks to stay at a steady size
        if len(live) > 50 * per_store:
            for h in live[:per_store]:
                events.append({"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0})
            del live[:per_store]
        parent = rng.choice(prefixes)  # a recent chain end (still cached) or a new root
        hashes = list(range(next_hash, next_hash + per_store))
        next_hash += per_store
        tokens = [rng.randrange(32000) for _ in range(per_store * block_size)]
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": tokens,
                "block_size": block_size,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None] * per_store,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        )
        live.extend(hashes)
        # parents: the ends of the last few chains (evicted last, so always still cached), or none
        prefixes.append(hashes[-1])
        if len(prefixes) > 9:
            del prefixes[1]
        events_total += sum(len(e["block_hashes"]) for e in events)
        ts += 0.01
        payloads.append(msgpack.packb([ts, events, 0]))
    return payloads, events_total


class NullSink:
    def stored(self, keys: list[int], parent: int | None, medium: str) -> None:
        pass

    def removed(self, keys: list[int], medium: str) -> None:
        pass

    def cleared(self) -> None:
        pass


class IndexSink:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def stored(self, keys: list[int], _parent: int | None, medium: str) -> None:
        self.index.store("r0", keys, medium)

    def removed(self, keys: list[int], _medium: str) -> None:
        self.index.remove("r0", keys)

    def cleared(self) -> None:
        self.index.clear_replica("r0")


class RecordingSink:
    def __init__(self) -> None:
        self.ops: list[tuple[bool, list[int], str]] = []

    def stored(self, keys: list[int], _parent: int | None, medium: str) -> None:
        self.ops.append((True, keys, medium))

    def removed(self, keys: list[int], medium: str) -> None:
        self.ops.append((False, keys, medium))

    def cleared(self) -> None:
        pass


class _Fleet:
    def agent_hello(self, _hello: AgentHello) -> str | None:
        return None

    def agent_load(self, replica_id: str, load: AgentLoad) -> None:
        pass

    def key_block_size(self, _models: Iterable[str]) -> int:
        return 0

    def agent_engine(self, replica_id: str, engine: AgentEngine) -> None:
        pass

    def agent_state(self, replica_id: str, *, connected: bool, degraded: bool) -> None:
        pass

    def snapshot_keep(self) -> tuple[float, float]:
        return time.monotonic(), SPECULATIVE_TTL_S  # as the gateway's fleet, at its default


def stage_decode(payloads: list[bytes]) -> Callable[[], None]:
    def run() -> None:
        for p in payloads:
            decode_payload(p)

    return run


def stage_rekey(payloads: list[bytes], block_size: int) -> Callable[[], None]:
    def run() -> None:
        inv = AgentInventory(MODEL, block_size, max_blocks=10_000_000, sink=NullSink())
        for p in payloads:
            inv.apply(decode_payload(p).events)

    return run


def agent_messages(payloads: list[bytes], block_size: int, per_message: int = 1) -> list[bytes]:
    """What the agent would send: one Events message per ``per_message`` engine batches (the agent
    flushes every 5 ms, so under load one message carries several engine steps)."""
    outbox = Outbox(max_events=10_000_000)
    outbox.open = True
    inv = AgentInventory(MODEL, block_size, max_blocks=10_000_000, sink=outbox)
    out = []
    seq = 2
    for i, p in enumerate(payloads):
        batch = decode_payload(p)
        inv.apply(batch.events)
        if (i + 1) % per_message == 0 or i == len(payloads) - 1:
            events = pb.Events(events=outbox.take(), engine_ts=batch.ts)
            out.append(pb.AgentMessage(seq=seq, events=events).SerializeToString())
            seq += 1
    return out


def stage_agent_total(payloads: list[bytes], block_size: int) -> Callable[[], None]:
    def run() -> None:
        agent_messages(payloads, block_size)

    return run


def stage_gateway(messages: list[bytes]) -> Callable[[], None]:
    def run() -> None:
        async def go() -> None:
            index = PrefixIndex(IndexConfig(max_blocks_per_replica=10_000_000, max_total_blocks=20_000_000))
            index.add_replica("r0")  # a configured replica: the fleet gives it to the index
            server = InventoryServer(
                index,
                _Fleet(),
                token=None,
                registry=CollectorRegistry(),
                settings=InventorySettings(ack_every=1_000_000),
            )
            stream = StreamState(peer="bench", task=None)
            hello = pb.AgentMessage(seq=1, hello=pb.Hello(replica_id="r0", block_size=16, protocol_version=1))
            server._handle(stream, hello.SerializeToString())
            stream.synced = True
            for raw in messages:
                server._handle(stream, raw)

        asyncio.run(go())

    return run


def stage_index(ops: list[tuple[bool, list[int], str]]) -> Callable[[], None]:
    def run() -> None:
        index = PrefixIndex(IndexConfig(max_blocks_per_replica=10_000_000, max_total_blocks=20_000_000))
        index.add_replica("r0")  # the index tracks only replicas it is given
        store, remove = index.store, index.remove
        for is_store, keys, medium in ops:
            if is_store:
                store("r0", keys, medium)
            else:
                remove("r0", keys)

    return run


def stage_agent_index(payloads: list[bytes], block_size: int) -> Callable[[], None]:
    def run() -> None:
        index = PrefixIndex(IndexConfig(max_blocks_per_replica=10_000_000, max_total_blocks=20_000_000))
        index.add_replica("r0")
        inv = AgentInventory(MODEL, block_size, max_blocks=10_000_000, sink=IndexSink(index))
        for p in payloads:
            inv.apply(decode_payload(p).events)

    return run


def timed(fn: Callable[[], None], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()  # CPU time of this (single-threaded) process: one core
        fn()
        best = min(best, time.process_time() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=20_000)
    ap.add_argument("--blocks-per-store", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, help="stage name to profile (e.g. 'agent+index')")
    args = ap.parse_args(argv)

    payloads, n_events = make_payloads(args.batches, args.blocks_per_store, args.block_size, args.seed)
    rec = RecordingSink()
    inv = AgentInventory(MODEL, args.block_size, max_blocks=10_000_000, sink=rec)
    for p in payloads:
        inv.apply(decode_payload(p).events)
    messages = agent_messages(payloads, args.block_size)
    batched = agent_messages(payloads, args.block_size, per_message=8)

    stages: dict[str, Callable[[], None]] = {
        "decode": stage_decode(payloads),
        "decode+rekey": stage_rekey(payloads, args.block_size),
        "agent total": stage_agent_total(payloads, args.block_size),
        "gateway apply": stage_gateway(messages),
        "gateway apply x8": stage_gateway(batched),
        "index apply": stage_index(rec.ops),
        "agent+index": stage_agent_index(payloads, args.block_size),
    }
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        stages[args.profile]()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        return 0
    print(
        f"{args.batches} engine batches, {n_events} block events "
        f"({args.blocks_per_store} blocks per store, block size {args.block_size}), best of {args.repeat}, one core"
    )
    print(f"{'stage':<16} {'seconds':>8} {'block events/s':>15} {'us/event':>9}")
    for name, fn in stages.items():
        s = timed(fn, args.repeat)
        print(f"{name:<16} {s:>8.3f} {n_events / s:>15,.0f} {1e6 * s / n_events:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
