"""Shared-state benchmark (not a test; prints figures): what publishing an agent's deltas to Redis
costs the owning gateway, and how fast and how soon a second instance follows.

    python bench/shared_state.py [--batches 20000] [--keys 16] [--probes 200]

Starts its own redis-server on a free loopback port (no persistence) and two ``SharedState``
instances in one process and event loop (so both share one core: the throughput is a lower bound
of two processes). Figures:

  hook cost          the owner's synchronous hook per agent batch (encode + enqueue), next to
                     ``PrefixIndex.store`` of the same batch (what the inventory server already pays)
  follow throughput  batches/s and keys/s from the owner's hook until the follower's index holds them
  propagation        one batch at a time on an idle pair: hook -> follower index, p50 / p99
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from gateway.app_parts import wire_shared_state
from gateway.config import GatewayConfig, parse_config
from gateway.fleet import Fleet
from gateway.inventory_ops import ops_of_events
from gateway.inventory_server import InventoryServer
from gateway.inventory_sink import AgentHello
from gateway.shared_state import SharedState
from kvgate_tools.redis_server import RedisServer
from proto.kvgate.v1 import inventory_pb2 as pb
from router_policies.prefix_index import PrefixIndex


def _instance(config: GatewayConfig, name: str) -> tuple[PrefixIndex, SharedState]:
    index = PrefixIndex(config.index)
    fleet = Fleet(config, index)
    registry = CollectorRegistry()
    inventory = InventoryServer(index, fleet, token=None, registry=registry)
    shared = wire_shared_state(config, index, fleet, inventory, registry, instance_id=name)
    return index, shared


async def _until(check: Callable[[], bool], timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise TimeoutError("the follower did not catch up")
        await asyncio.sleep(0.0005)


async def _run(url: str, batches: int, nkeys: int, probes: int) -> None:
    config = parse_config(
        {
            "models": [{"name": "m"}],
            "index": {"max_blocks_per_replica": 2_000_000, "max_total_blocks": 8_000_000},
            # a queue that holds the whole burst: this measures throughput, not drops
            "shared_state": {"redis_url": url, "key_prefix": "bench", "publish_queue": batches + 10},
        }
    )
    _, a = _instance(config, "a")
    idx_b, b = _instance(config, "b")
    await a.start()
    await b.start()
    try:
        await _until(lambda: a.up and b.up, 30)
        a.publisher.inventory_hello(AgentHello("r0", "http://127.0.0.1:9", ("m",), 16, 0, "bench", "", ""))
        a.publisher.inventory_snapshot("r0", {})
        await _until(lambda: "r0" in b.status()["following"], 30)  # type: ignore[operator]

        events = [
            [pb.Event(stored=pb.Stored(keys=range(i * nkeys + 1, (i + 1) * nkeys + 1)))]
            for i in range(batches)
        ]
        # hook cost, next to the index apply the inventory server already does for the same batch
        scratch = PrefixIndex(config.index)
        for name in ("warm", "r0"):  # the index tracks only replicas it is given
            scratch.add_replica(name)
        scratch.store("warm", [1, 2, 3])  # compile the index's kernels before timing
        t0 = time.perf_counter()
        for evs in events:
            scratch.store("r0", evs[0].stored.keys)
        store_s = time.perf_counter() - t0
        hook_s = 0.0
        t0 = time.perf_counter()
        for i in range(0, batches, 100):
            # the agent's messages arrive one by one: let the loop run between bursts of 100
            t1 = time.perf_counter()
            for evs in events[i : i + 100]:
                a.publisher.inventory_ops("r0", ops_of_events(evs))
            hook_s += time.perf_counter() - t1
            await asyncio.sleep(0)
        await _until(lambda: idx_b.precise_count("r0") == batches * nkeys)
        follow_s = time.perf_counter() - t0

        lat: list[float] = []
        base = batches * nkeys + 1
        for p in range(probes):
            keys = range(base + p * nkeys, base + (p + 1) * nkeys)
            want = idx_b.precise_count("r0") + nkeys
            t1 = time.perf_counter()
            a.publisher.inventory_ops("r0", ops_of_events([pb.Event(stored=pb.Stored(keys=keys))]))
            await _until(lambda want=want: idx_b.precise_count("r0") >= want)  # type: ignore[misc]
            lat.append(time.perf_counter() - t1)
        lat.sort()
    finally:
        await a.stop()
        await b.stop()

    print(f"batches {batches} x {nkeys} keys, one process (owner and follower share a core)")
    print(
        f"hook cost           {hook_s / batches * 1e6:8.1f} us/batch   "
        f"(PrefixIndex.store of the batch: {store_s / batches * 1e6:.1f} us; ratio {hook_s / store_s:.2f})"
    )
    print(
        f"follow throughput   {batches / follow_s:8.0f} batches/s  {batches * nkeys / follow_s:,.0f} keys/s"
    )
    print(
        f"propagation         p50 {lat[len(lat) // 2] * 1e3:.2f} ms   "
        f"p99 {lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3:.2f} ms   ({probes} probes)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=20000)
    ap.add_argument("--keys", type=int, default=16, help="keys per stored batch")
    ap.add_argument("--probes", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            asyncio.run(_run(server.url, args.batches, args.keys, args.probes))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
