"""The simulator runs the router the gateway runs: the gateway's ``Router`` + ``Fleet`` +
``PrefixIndex`` (in process, its housekeeping loop emulated tick by tick) and the simulator's
decision path (``SimGateway``, with its own defaults) are driven with the same requests, the same
engine events (blocks stored and removed, load reports, first bytes and ends) on the same clock,
and must make the same choices on the same snapshots and leave the same index, entry by entry,
with the same expiry times.

The gateway side is written as the gateway's modules do it (the proxy's flight, the inventory
server's stores, the app's one-second sweep with ``placement.EXPIRE_INTERVAL_S``), not through
``router_policies.placement``, so a simulator that drifted from any of them (another speculative
lifetime, another pending-prefill rule, another sweep period) fails here; the last test shows a
different lifetime is caught."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.config import GatewayConfig, parse_config
from gateway.features import Featurizer
from gateway.fleet import Fleet, Flight
from gateway.inventory_sink import AgentHello, AgentLoad
from gateway.routing import Router, RoutingState
from router_policies.placement import EXPIRE_INTERVAL_S, Dispatch, TouchRule
from router_policies.placement import Flight as SimFlight
from router_policies.policy import RequestFeatures
from router_policies.prefix_index import PrefixIndex
from router_policies.registry import build_policy
from router_policies.sim.sim_gateway import SimGateway

REPLICAS = ["r0", "r1", "r2"]
BS = 16
# kv_aware's default rule is ``tokens``; ``rule: ms`` (opt-in) also reads the fitted TTFT models
POLICIES: list[tuple[str, dict[str, Any]]] = [
    ("kv_aware", {}),
    ("kv_aware", {"rule": "ms"}),
    ("round_robin", {}),
    ("least_loaded", {}),
    ("consistent_hash", {}),
]


def _config() -> GatewayConfig:
    # the gateway's defaults (index TTL, speculative TTL), small bounds so evictions happen
    return parse_config(
        {
            "models": [{"name": "m", "block_size": BS}],
            "replicas": [{"id": r, "url": f"http://{r}:8000"} for r in REPLICAS],
            "index": {"approximate_blocks_per_replica": 40},
        }
    )


@dataclass(order=True)
class _Event:
    t: float
    seq: int
    kind: str = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)


def _workload(seed: int) -> list[_Event]:
    """Sessions whose prompts grow turn by turn over shared tenant heads; arrivals with gaps
    longer than the speculative lifetime now and then; load reports at random times."""
    rng = random.Random(seed)
    heads = [[rng.getrandbits(63) for _ in range(rng.randrange(1, 4))] for _ in range(3)]
    sessions = [list(rng.choice(heads)) for _ in range(10)]
    events: list[_Event] = []
    t = 0.0
    for i in range(240):
        t += rng.choice([0.05, 0.3, 0.9, 2.0, 4.0, 13.0])
        s = rng.randrange(len(sessions))
        sessions[s] += [rng.getrandbits(63) for _ in range(rng.randrange(0, 4))]  # 0: sent again
        keys = list(sessions[s])
        prompt = len(keys) * BS + rng.choice([0, 0, 5, 15])
        events.append(_Event(t, len(events), "arrive", (i, keys, prompt, rng.randrange(1, 60), f"s{s}")))
        if rng.random() < 0.3:
            r = rng.choice(REPLICAS)
            events.append(
                _Event(t + 0.01, len(events), "load", (r, rng.randrange(4), rng.randrange(3), rng.random()))
            )
    return events


class _GatewaySide:
    def __init__(self, cfg: GatewayConfig, policy: tuple[str, dict[str, Any]]) -> None:
        self.now = 0.0
        self.index = PrefixIndex(cfg.index)
        self.fleet = Fleet(cfg, self.index, clock=lambda: self.now)
        for r in REPLICAS:  # checked healthy, each with its agent connected
            self.fleet.check_result(r, True)
            assert (
                self.fleet.agent_hello(AgentHello(r, f"http://{r}:8000", ("m",), BS, 100, "vllm", "0", "1"))
                is None
            )
            self.fleet.agent_state(r, connected=True, degraded=False)
        self.router = Router(self.index, self.fleet)
        self.state = RoutingState(cfg, build_policy(*policy, seed=3), Featurizer.from_config(cfg))
        self.flights: dict[int, Flight] = {}
        self._next_tick: float | None = None

    def clock(self, t: float) -> None:
        """The app's housekeeping loop: ``index.expire(now)`` every EXPIRE_INTERVAL_S."""
        if self._next_tick is None:
            self._next_tick = t + EXPIRE_INTERVAL_S
        while self._next_tick <= t:
            self.index.expire(self._next_tick)
            self._next_tick += EXPIRE_INTERVAL_S
        self.now = t

    def route(self, rid: int, feats: RequestFeatures, out: int) -> tuple[Any, ...]:
        choice = self.router.choose(self.state, feats)
        # as the proxy's attempt does
        prefill = max(0, feats.prompt_tokens - choice.predicted_tokens)
        dispatch = Dispatch.of(choice.state, feats, choice.predicted_tokens, out)
        self.flights[rid] = self.fleet.dispatch(choice.record, dispatch)
        assert self.flights[rid].prefill == prefill
        return choice.decision, choice.snapshot, choice.predicted_tokens


class _SimSide:
    def __init__(
        self, cfg: GatewayConfig, policy: tuple[str, dict[str, Any]], touch: TouchRule | None
    ) -> None:
        self.loads = {r: (0, 0, 0.0) for r in REPLICAS}
        self.index = PrefixIndex(cfg.index)
        self.gw = SimGateway(
            REPLICAS, build_policy(*policy, seed=3), self.index, lambda i: self.loads[REPLICAS[i]], touch
        )
        for r in REPLICAS:  # the engines' KV capacity, as the gateway's agents' hellos say (100 blocks)
            self.gw.ttft.set_kv_capacity(r, 100 * BS)
        self.flights: dict[int, SimFlight] = {}

    def route(self, rid: int, feats: RequestFeatures, out: int, t: float) -> tuple[Any, ...]:
        routed = self.gw.route(feats, out, t)
        self.flights[rid] = routed.flight
        return routed.decision, routed.snapshot, routed.predicted_tokens


def _index_state(index: PrefixIndex) -> dict[str, tuple[list[tuple[int, float]], list[int]]]:
    return {r: (index.approximate_expiry(r), sorted(index.precise_keys(r))) for r in REPLICAS}


def _first_difference(
    policy: tuple[str, dict[str, Any]], seed: int, touch: TouchRule | None = None
) -> str | None:
    """Run both sides; the first difference found, or None."""
    cfg = _config()
    gw, sim = _GatewaySide(cfg, policy), _SimSide(cfg, policy, touch)
    rng = random.Random(seed + 1)
    queue = _workload(seed)
    heapq.heapify(queue)
    seq = len(queue)
    while queue:
        ev = heapq.heappop(queue)
        gw.clock(ev.t)
        follow: list[tuple[float, str, tuple[Any, ...]]] = []
        if ev.kind == "arrive":
            rid, keys, prompt, out, session = ev.args
            feats = RequestFeatures(
                model="m", block_keys=keys, prompt_tokens=prompt, block_size=BS, session_id=session
            )
            a, b = gw.route(rid, feats, out), sim.route(rid, feats, out, ev.t)
            if a != b:
                return f"request {rid} at {ev.t}: gateway {a} != simulator {b}"
            replica = a[0].replica
            # the engine: prefill ends (its blocks stored, first byte) after a queue that is
            # sometimes longer than the speculative lifetime; it ends later and may evict
            done = ev.t + rng.choice([0.1, 0.5, 2.0, 6.0, 12.0])
            follow.append((done, "store", (replica, keys)))
            follow.append((done + 0.001, "first_byte", (rid,)))
            follow.append((done + rng.random() * 5, "end", (rid,)))
            if rng.random() < 0.25:
                follow.append((done + rng.random() * 20, "remove", (replica, keys[len(keys) // 2 :])))
        elif ev.kind == "load":
            r, running, waiting, kv = ev.args
            gw.fleet.agent_load(r, AgentLoad(running, waiting, kv, 0, 0))
            sim.loads[r] = (running, waiting, kv)
        elif ev.kind == "store":
            replica, keys = ev.args
            gw.index.store(replica, keys)  # as the inventory server applies a BlockStored
            sim.gw.stored(replica, keys, ev.t)
        elif ev.kind == "remove":
            replica, keys = ev.args
            gw.index.remove(replica, keys)
            sim.gw.removed(replica, keys, ev.t)
        elif ev.kind == "first_byte":
            gw.flights[ev.args[0]].first_byte()  # the fleet's clock: ev.t
            sim.flights[ev.args[0]].first_byte(ev.t)
        else:
            gw.flights.pop(ev.args[0]).end()
            sim.flights.pop(ev.args[0]).end()
        sim.gw.advance(ev.t)  # the simulator's sweep due at this instant (as before its next event)
        if _index_state(gw.index) != _index_state(sim.index):
            return f"index after {ev.kind} at {ev.t}: gateway {_index_state(gw.index)} != simulator {_index_state(sim.index)}"
        for t, kind, args in follow:
            heapq.heappush(queue, _Event(t, seq, kind, args))
            seq += 1
    return None


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_simulator_and_gateway_decide_the_same_and_leave_the_same_index(
    policy: tuple[str, dict[str, Any]], seed: int
) -> None:
    assert _first_difference(policy, seed) is None


def test_the_workload_exercises_expiry_eviction_and_matches() -> None:
    """The comparison covers what could differ: speculative entries expire before the engine's
    events, capacity evicts, requests match cached prefixes."""
    cfg = _config()
    sim = _SimSide(cfg, ("kv_aware", {}), None)
    expired = matched = 0
    for ev in sorted(_workload(0)):
        if ev.kind != "arrive":
            continue
        rid, keys, prompt, out, session = ev.args
        before = sim.index.entries
        sim.gw.advance(ev.t)
        expired += before - sim.index.entries
        routed = sim.route(rid, RequestFeatures("m", keys, prompt, BS, session), out, ev.t)
        matched += routed[0].matched_blocks > 0
    assert expired > 0 and matched > 50
    assert max(len(sim.index.approximate_keys(r)) for r in REPLICAS) == 40  # at its capacity


def test_the_simulators_default_lifetime_is_the_gateways() -> None:
    assert TouchRule().speculative_ttl_s == _config().proxy.speculative_ttl_s


def test_a_simulator_with_another_speculative_lifetime_is_caught() -> None:
    """The index TTL (120 s) instead of proxy.speculative_ttl_s: what the simulator used before."""
    found = _first_difference(("kv_aware", {}), 0, TouchRule(speculative_ttl_s=120.0))
    assert found is not None and "index after" in found
