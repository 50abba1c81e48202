"""Fleet state: health transitions, in-flight bookkeeping, agents, reconfiguration; and the
routing step's prediction and speculative index entries."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from gateway.config import GatewayConfig, parse_config
from gateway.features import Featurizer
from gateway.fleet import Fleet, RemoteLoad
from gateway.inventory_sink import AgentHello, AgentLoad
from gateway.routing import Router, RoutingState
from router_policies.policy import NoReplicaError, RequestFeatures
from router_policies.prefix_index import MatchResult, PrefixIndex, UnknownReplicaError
from router_policies.registry import build_policy
from tests.unit.fleet_requests import NO_REQUEST


def _config(**extra: Any) -> GatewayConfig:
    tree: dict[str, Any] = {
        "models": [{"name": "m", "block_size": 16}, {"name": "n", "block_size": 32}],
        "replicas": [
            {"id": "a", "url": "http://a:1", "models": ["m"]},
            {"id": "b", "url": "http://b:1"},
        ],
        "health": {"unhealthy_after": 2, "healthy_after": 2},
    }
    tree.update(extra)
    return parse_config(tree)


def _hello(rid: str, block_size: int = 16, models: tuple[str, ...] = ("m",)) -> AgentHello:
    return AgentHello(rid, f"http://{rid}:8000/", models, block_size, 100, "vllm", "0.32", "1")


def test_static_replicas_start_unknown_and_the_first_check_decides() -> None:
    fleet = Fleet(_config(), PrefixIndex())
    assert [r.id for r in fleet.records()] == ["a", "b"]
    assert not fleet.any_healthy()
    fleet.check_result("a", True)
    fleet.check_result("b", False, "refused")
    assert fleet.get("a").healthy and not fleet.get("b").healthy  # type: ignore[union-attr]
    assert fleet.any_healthy()


def test_ejection_and_recovery_follow_the_thresholds() -> None:
    now = [100.0]
    fleet = Fleet(_config(), PrefixIndex(), clock=lambda: now[0])
    fleet.check_result("a", True)
    a = fleet.get("a")
    assert a is not None
    fleet.proxy_failure(a, "502")
    assert a.healthy  # one failure of two
    fleet.proxy_success(a)
    fleet.proxy_failure(a, "502")
    assert a.healthy  # a success in between resets the streak
    fleet.proxy_failure(a, "502")
    assert not a.healthy and a.health.last_error == "502"
    fleet.check_result("a", True)
    assert not a.healthy  # one success of two
    fleet.check_result("a", True)
    assert not a.healthy  # two, but ejected by its requests: held out for health.ejection_s (5 s)
    now[0] += 5.0
    fleet.check_result("a", True)
    assert a.healthy and a.health.failures == 3


def test_connect_error_ejects_at_once() -> None:
    fleet = Fleet(_config(), PrefixIndex())
    fleet.check_result("a", True)
    a = fleet.get("a")
    assert a is not None
    fleet.proxy_failure(a, "connection refused", connect=True)
    assert not a.healthy


def test_flights_load_the_record_and_the_snapshot_until_released() -> None:
    # the accounting itself: tests/unit/test_placement.py
    fleet = Fleet(_config(), PrefixIndex())
    a = fleet.get("a")
    assert a is not None
    fleet.check_result("a", True)
    fleet.apply_remote_load({"a": RemoteLoad(requests=1, tokens=10, prefill=5)})
    flight = Fleet.begin(a, tokens=150, prefill=100)
    assert (a.in_flight_requests, a.in_flight_tokens, a.pending_prefill_tokens, a.requests) == (
        1,
        150,
        100,
        1,
    )
    (state,) = fleet.snapshot([a], NO_REQUEST, MatchResult({}, {})).replicas
    assert (state.in_flight_requests, state.in_flight_tokens, state.pending_prefill_tokens) == (2, 160, 105)
    flight.end()
    assert (a.in_flight_requests, a.in_flight_tokens, a.pending_prefill_tokens, a.requests) == (0, 0, 0, 1)


def test_snapshot_is_immutable_and_honours_exclusions() -> None:
    fleet = Fleet(_config(), PrefixIndex())
    for rid in ("a", "b"):
        fleet.check_result(rid, True)
    cands = fleet.candidates("m")
    assert [r.id for r in cands] == ["a", "b"]
    assert [r.id for r in fleet.candidates("n")] == ["b"]  # a serves m only; b serves all
    snap = fleet.snapshot(cands, NO_REQUEST, MatchResult({"a": 3}, {"a": 2.5}), exclude=frozenset({"b"}))
    a, b = snap.replicas
    assert (a.matched_blocks, a.match_score, a.healthy) == (3, 2.5, True)
    assert (b.matched_blocks, b.healthy) == (0, False)
    with pytest.raises(AttributeError):
        a.healthy = False  # type: ignore[misc]


def test_agent_registers_its_replica_and_reports_load() -> None:
    index = PrefixIndex()
    fleet = Fleet(_config(), index)
    assert fleet.agent_hello(_hello("c")) is None
    c = fleet.get("c")
    assert c is not None and not c.static and c.url == "http://c:8000" and c.healthy
    assert "c" in index.replicas
    fleet.agent_state("c", connected=True, degraded=True)
    assert fleet.has_agent("c") and c.link.degraded
    fleet.agent_load("c", AgentLoad(running=3, waiting=2, kv_usage=0.5, prefix_queries=0, prefix_hits=0))
    assert (c.engine_running, c.engine_waiting, c.kv_usage) == (3, 2, 0.5)
    fleet.agent_state("c", connected=False, degraded=False)
    assert not fleet.has_agent("c") and (c.engine_running, c.kv_usage) == (0, 0.0)
    # an agent of a static replica attaches to it without changing its configured URL
    assert fleet.agent_hello(_hello("a")) is None
    assert fleet.get("a").url == "http://a:1"  # type: ignore[union-attr]


def test_agent_hello_refusals() -> None:
    fleet = Fleet(_config(), PrefixIndex())
    msg = fleet.agent_hello(_hello("c", block_size=32))  # m has block_size 16
    assert msg is not None and "block size 32" in msg and "models[m].block_size=16" in msg
    # An engine block dividing the gateway's (n keys at 32) is accepted only to be re-keyed: the
    # gateway's size goes back on the Ack of the Hello (the agent then re-keys and says Hello
    # again), and keys of the smaller size are refused on the stream, never applied unmatched
    # (the case "keys at a divisor, not re-keyed" of kvgate_tools/faults/abuse_cases.py, which
    # tests/integration/test_inventory_abuse.py runs;
    # tests/unit/test_sglang_rekey.py, the agent's side).
    assert fleet.agent_hello(_hello("d", block_size=16, models=("n",))) is None
    assert fleet.key_block_size(("n",)) == 32 and fleet.key_block_size(("m",)) == 16
    closed = Fleet(_config(inventory={"allow_registration": False}), PrefixIndex())
    msg = closed.agent_hello(_hello("c"))
    assert msg is not None and "allow_registration" in msg
    assert closed.agent_hello(_hello("a")) is None  # listed replicas are always accepted


def test_registered_replicas_are_bounded_by_the_index() -> None:
    cfg = _config(index={"max_replicas": 3})
    fleet = Fleet(cfg, PrefixIndex(cfg.index))
    assert fleet.agent_hello(_hello("c")) is None
    msg = fleet.agent_hello(_hello("d"))
    assert msg is not None and "max_replicas=3" in msg
    assert fleet.get("d") is None


def test_reconfigure_adds_updates_and_removes_static_replicas() -> None:
    index = PrefixIndex()
    fleet = Fleet(_config(), index)
    fleet.check_result("a", True)
    fleet.agent_hello(_hello("b"))
    fleet.agent_state("b", connected=True, degraded=False)
    new = _config(replicas=[{"id": "a", "url": "http://a:2"}, {"id": "z", "url": "http://z:1"}])
    assert fleet.reconfigure(new) == []  # b keeps its agent, so it stays (as agent-registered)
    a, b, z = fleet.get("a"), fleet.get("b"), fleet.get("z")
    assert a is not None and b is not None and z is not None
    assert a.url == "http://a:2" and not a.healthy  # a new address is unknown until checked
    assert not b.static and z.static
    fleet.agent_state("b", connected=False, degraded=False)
    assert fleet.reconfigure(_config(replicas=[{"id": "z", "url": "http://z:1"}])) == ["a"]
    assert "a" not in index.replicas and fleet.get("a") is None


def _state(cfg: GatewayConfig) -> RoutingState:
    return RoutingState(cfg, build_policy("kv_aware", {}, seed=0), Featurizer.from_config(cfg))


def test_router_choice_records_a_speculative_entry_with_the_right_ttl() -> None:
    cfg = _config(index={"approximate_ttl_s": 100.0}, proxy={"speculative_ttl_s": 5.0})
    index = PrefixIndex(cfg.index)
    fleet = Fleet(cfg, index)
    for rid in ("a", "b"):
        fleet.check_result(rid, True)
    router = Router(index, fleet)
    state = _state(cfg)
    feats = RequestFeatures(model="m", block_keys=[11, 12, 13], prompt_tokens=60, block_size=16)
    choice = router.choose(state, feats)
    first = choice.record.id
    assert choice.predicted_tokens == 0
    assert index.approximate_keys(first) == [13, 12, 11]
    again = router.choose(state, feats)
    assert again.record.id == first and again.decision.matched_blocks == 3
    assert again.predicted_tokens == 48
    # decide (without commit) never touches the index nor the live policy
    before = index.entries
    router.decide(state, feats, router.match(feats))
    assert index.entries == before
    # a replica with an agent gets entries that expire after speculative_ttl_s, not the index TTL
    other = "b" if first == "a" else "a"
    fleet.agent_hello(_hello(other))
    fleet.agent_state(other, connected=True, degraded=False)
    feats2 = RequestFeatures(model="m", block_keys=[21, 22], prompt_tokens=40, block_size=16)
    c2 = router.choose(state, feats2, exclude=frozenset({first}))
    assert c2.record.id == other and index.approximate_keys(other) == [22, 21]
    now = time.monotonic()
    index.expire(now + 6.0)
    assert index.approximate_keys(other) == []
    assert index.approximate_keys(first) == [13, 12, 11]


def test_router_refreshes_a_hot_chains_entries_at_most_once_a_second() -> None:
    cfg = _config()
    index = PrefixIndex(cfg.index)
    fleet = Fleet(cfg, index)
    fleet.check_result("a", True)
    router = Router(index, fleet)
    router.touch("a", [11, 12, 13])
    router.touch("a", [11, 14])  # shares the root: 11 moves behind 14
    assert index.approximate_keys("a") == [13, 12, 14, 11]
    router.touch("a", [11, 12, 13])  # its leaf was stamped just now: nothing to do
    assert index.approximate_keys("a") == [13, 12, 14, 11]
    router.touch("a", [11, 12, 13, 15])  # a longer chain is new: touched
    assert index.approximate_keys("a") == [14, 15, 13, 12, 11]
    index.store("a", [21, 22])  # held precisely (the engine's events came): never duplicated
    router.touch("a", [21, 22])
    assert index.approximate_keys("a") == [14, 15, 13, 12, 11]
    router.touch("gone", [31])  # a replica no longer in the fleet gets nothing
    assert "gone" not in index.replicas


def test_router_raises_when_nothing_is_healthy() -> None:
    cfg = _config()
    index = PrefixIndex(cfg.index)
    router = Router(index, Fleet(cfg, index))
    feats = RequestFeatures(model="m", block_keys=[], prompt_tokens=1, block_size=16)
    with pytest.raises(NoReplicaError):
        router.choose(_state(cfg), feats)


def test_agent_replicas_long_gone_are_forgotten_static_ones_never() -> None:
    cfg = _config(health={"unhealthy_after": 1, "healthy_after": 1, "forget_after_s": 60.0})
    index = PrefixIndex(cfg.index)
    # a clock on whole seconds: on time.monotonic(), (t + 60) - t is below 60 for some t
    fleet = Fleet(cfg, index, clock=lambda: 5000.0)
    fleet.check_result("a", True)
    assert fleet.agent_hello(_hello("c")) is None
    fleet.agent_state("c", connected=True, degraded=False)
    for rid in ("a", "c"):
        fleet.check_result(rid, False, "down")
    c = fleet.get("c")
    assert c is not None and c.health.unhealthy_since is not None
    t = c.health.unhealthy_since
    assert fleet.forget_stale(t + 3600, 60.0) == []  # its agent is still connected
    fleet.agent_state("c", connected=False, degraded=False)
    assert fleet.forget_stale(t + 59, 60.0) == []  # not long enough
    assert fleet.forget_stale(t + 60, 60.0) == ["c"]
    assert fleet.get("c") is None and "c" not in index.replicas
    assert fleet.get("a") is not None  # static: only the config removes it
    # a replica that recovered in between is kept
    assert fleet.agent_hello(_hello("d")) is None
    fleet.check_result("d", False, "down")
    fleet.check_result("d", True)
    assert fleet.forget_stale(5000.0 + 3600, 60.0) == []


def test_the_fleet_alone_changes_the_index_replica_set() -> None:
    index = PrefixIndex()
    fleet = Fleet(_config(), index)
    assert index.replicas == ["a", "b"]
    with pytest.raises(UnknownReplicaError):
        index.store("c", [1])  # an agent's events for a replica the fleet does not hold
    assert fleet.agent_hello(_hello("c")) is None and index.replicas == ["a", "b", "c"]
    # a static replica another gateway instance follows through Redis is kept (as registered)
    # when the config drops it: the follower still writes its inventory into the index
    fleet.set_shared_inventory("a", True)
    assert fleet.reconfigure(_config(replicas=[{"id": "b", "url": "http://b:1"}])) == []
    a = fleet.get("a")
    assert a is not None and not a.static and "a" in index.replicas
    fleet.set_shared_inventory("a", False)
    assert fleet.reconfigure(_config(replicas=[{"id": "b", "url": "http://b:1"}])) == []  # not static now
    assert [r.id for r in fleet.records()] == ["a", "b", "c"] == index.replicas


def test_record_parts_are_written_by_their_owners_only() -> None:
    fleet = Fleet(_config(), PrefixIndex())
    a = fleet.get("a")
    assert a is not None
    for name in ("healthy", "url", "in_flight_requests", "agent_connected", "kv_usage"):
        with pytest.raises(AttributeError):
            setattr(a, name, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.identity.url = "http://elsewhere:1"  # type: ignore[misc]


def test_speculative_entries_of_a_replica_whose_agent_connects_later_expire_in_time() -> None:
    """Entries touched before the agent connected (index TTL) must not hold back the ones touched
    after (speculative_ttl_s): every entry is gone speculative_ttl_s after the last touch."""
    now = [1000.0]
    cfg = _config(index={"approximate_ttl_s": 120.0}, proxy={"speculative_ttl_s": 10.0})
    index = PrefixIndex(cfg.index)
    fleet = Fleet(cfg, index, clock=lambda: now[0])
    fleet.touch("b", [1, 2])  # no agent: lives 120 s
    assert fleet.agent_hello(_hello("b")) is None
    fleet.agent_state("b", connected=True, degraded=False)
    now[0] += 5.0
    fleet.touch("b", [3, 4])  # with the agent: lives 10 s
    assert [t for _, t in index.approximate_expiry("b")] == [1015.0] * 4
    index.expire(1015.5)  # the app's housekeeping sweep
    assert index.approximate_keys("b") == []


def test_health_transitions_are_stamped_by_the_fleets_clock() -> None:
    now = [50.0]
    fleet = Fleet(_config(), PrefixIndex(), clock=lambda: now[0])
    fleet.check_result("a", False, "refused")
    a = fleet.get("a")
    assert a is not None and a.health.unhealthy_since == 50.0 and a.health.last_error == "refused"
