"""A replica added to a warm fleet takes its share of new content (issue 11): three replicas
whose caches are full serve a session workload at concurrency 8; a fourth joins (its agent says
hello) and the share of the next 300 requests it receives is measured (``new_replica_share`` in
``make bench``'s summary; tests/integration/test_new_replica_share.py wants >= 15%).

The gateway's own ``Fleet`` + ``Router`` + ``PrefixIndex`` decide; each replica's engine is a
bounded LRU of blocks whose stores and evictions reach the index as its agent's events would,
when a request's first token comes (8 clients in a closed loop: at most 8 in flight). First bytes
are timed by a linear engine (a fixed step and a cost per uncached token, serving its own
requests one after another) three times faster than the TTFT model's default prior, so the warm
replicas' fitted models differ from the prior: a joining replica starts from its peers' fit
(``placement.TtftFeed.adopt``) and must not look slower than them for want of observations.

    .venv/bin/python -m bench.new_replica [--policy kv_aware] [--out bench/results/new_replica.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from gateway.config import parse_config
from gateway.features import Featurizer
from gateway.fleet import Fleet
from gateway.inventory_sink import AgentHello
from gateway.routing import Router, RoutingState
from router_policies.placement import Dispatch, Flight
from router_policies.policy import RequestFeatures
from router_policies.prefix_index import PrefixIndex
from router_policies.registry import build_policy

BS = 16
CACHE_BLOCKS = 600  # per engine
CONCURRENCY = 8
STEP_MS, MS_PER_TOKEN = 2.5, 0.013  # the emulated engines: ~1/3 of the default prior's costs


@dataclass
class _Engine:
    index: PrefixIndex
    replica: str
    lru: OrderedDict[int, None]
    busy_until: float = 0.0

    def first_token_at(self, start: float, uncached: int) -> float:
        """Requests are prefilled one after another: this one starts when the engine is free."""
        self.busy_until = max(self.busy_until, start) + (STEP_MS + MS_PER_TOKEN * uncached) / 1000
        return self.busy_until

    def prefill(self, keys: list[int]) -> None:
        """The request's blocks stored (leaf last), the least recently used evicted."""
        for k in keys:
            self.lru[k] = None
            self.lru.move_to_end(k)
        self.index.store(self.replica, keys)
        gone = []
        while len(self.lru) > CACHE_BLOCKS:
            gone.append(self.lru.popitem(last=False)[0])
        if gone:
            self.index.remove(self.replica, gone)


class _Bench:
    def __init__(self, policy: str) -> None:
        self.now = 0.0
        cfg = parse_config({"models": [{"name": "m", "block_size": BS}], "replicas": []})
        self.index = PrefixIndex(cfg.index)
        self.fleet = Fleet(cfg, self.index, clock=lambda: self.now)
        self.router = Router(self.index, self.fleet)
        self.state = RoutingState(cfg, build_policy(policy, {}, seed=1), Featurizer.from_config(cfg))
        self.engines: dict[str, _Engine] = {}
        # (first token at, seq, flight, replica, keys), earliest first token first
        self.flights: list[tuple[float, int, Flight, str, list[int]]] = []
        self._seq = 0
        self.rng = random.Random(7)
        self.head = [self.rng.getrandbits(63) for _ in range(4)]  # a system prompt every session shares
        self.sessions: list[list[int]] = []

    def join(self, replica: str) -> None:
        hello = AgentHello(replica, f"http://{replica}:8000", ("m",), BS, CACHE_BLOCKS, "vllm", "0", "1")
        assert self.fleet.agent_hello(hello) is None
        self.fleet.agent_state(replica, connected=True, degraded=False)
        self.engines[replica] = _Engine(self.index, replica, OrderedDict())

    def _complete_first(self) -> None:
        """The in-flight request whose first token comes first completes (the clock moves on to
        it if it is later than now: a closed loop of CONCURRENCY clients)."""
        first_at, _seq, flight, replica, keys = heapq.heappop(self.flights)
        self.now = max(self.now, first_at)
        self.engines[replica].prefill(keys)
        flight.first_byte(first_at)
        flight.end()

    def request(self) -> str:
        """One request (a new session a third of the time, else a session's next turn)."""
        self.now += 0.002
        while self.flights and self.flights[0][0] <= self.now:
            self._complete_first()
        if not self.sessions or self.rng.random() < 1 / 3:
            self.sessions.append(list(self.head))
        s = self.rng.randrange(len(self.sessions))
        self.sessions[s] += [self.rng.getrandbits(63) for _ in range(self.rng.randrange(4, 12))]
        keys = list(self.sessions[s])
        feats = RequestFeatures("m", keys, len(keys) * BS + 5, BS, f"s{s}")
        choice = self.router.choose(self.state, feats)
        d = Dispatch.of(choice.state, feats, choice.predicted_tokens, 100)
        rid = choice.record.id
        first_at = self.engines[rid].first_token_at(self.now, feats.prompt_tokens - choice.predicted_tokens)
        self._seq += 1
        heapq.heappush(self.flights, (first_at, self._seq, self.fleet.dispatch(choice.record, d), rid, keys))
        if len(self.flights) >= CONCURRENCY:
            self._complete_first()
        return choice.record.id


def new_replica_share(policy: str = "kv_aware") -> float:
    bench = _Bench(policy)
    for r in ("r0", "r1", "r2"):
        bench.join(r)
    for _ in range(1500):
        bench.request()
    assert all(len(e.lru) == CACHE_BLOCKS for e in bench.engines.values())  # warm: caches full
    bench.join("r3")
    # its own model starts from a warm peer's fit, not the prior (and until its first token it is
    # priced as its peers: router_policies.ttft.freshness, unseen)
    joined = bench.fleet.ttft.model.params("r3")
    peers = [bench.fleet.ttft.params(r) for r in ("r0", "r1", "r2")]
    assert joined.observations == 0 and all(p.observations > 100 for p in peers)
    assert joined.coefficients() in [p.coefficients() for p in peers]  # a peer's fit
    routed = [bench.request() for _ in range(300)]
    return routed.count("r3") / len(routed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="kv_aware")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results/new_replica.json")
    args = ap.parse_args(argv)
    share = new_replica_share(args.policy)
    print(f"new replica share ({args.policy}): {share:.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"policy": args.policy, "new_replica_share": round(share, 4)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
