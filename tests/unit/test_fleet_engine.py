"""What the agent's EngineState changes in the fleet: hybrid replicas (deepest-key match, a routed
prompt's last block as its speculative entry) and LoRA adapters (a request naming one goes to
replicas holding it, else the model's ``lora_fallback``)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import GatewayConfig, parse_config
from gateway.features import Featurizer
from gateway.fleet import Fleet
from gateway.inventory_sink import AgentEngine, AgentHello
from gateway.routing import Router, RoutingState
from router_policies.policy import NoReplicaError, RequestFeatures
from router_policies.prefix_index import PrefixIndex
from router_policies.registry import build_policy


def _setup(
    fallback: str = "any", policy: str = "round_robin"
) -> tuple[Fleet, PrefixIndex, Router, RoutingState]:
    tree: dict[str, Any] = {
        "models": [{"name": "m", "block_size": 16, "lora_adapters": ["sql"], "lora_fallback": fallback}],
        "replicas": [{"id": r, "url": f"http://{r}:1"} for r in ("a", "b", "c")],
    }
    cfg: GatewayConfig = parse_config(tree)
    index = PrefixIndex(cfg.index)
    fleet = Fleet(cfg, index)
    for r in ("a", "b", "c"):
        fleet.check_result(r, True)
        fleet.agent_hello(AgentHello(r, f"http://{r}:1", ("m",), 16, 100, "vllm", "0.32", "1"))
    state = RoutingState(cfg, build_policy(policy, {}, seed=0), Featurizer.from_config(cfg))
    return fleet, index, Router(index, fleet), state


def _engine(adapters: tuple[str, ...] | None = None, hybrid: bool = False) -> AgentEngine:
    return AgentEngine(hybrid, frozenset(adapters or ()), adapters is not None)


def test_a_lora_request_goes_only_to_replicas_holding_the_adapter() -> None:
    fleet, _, router, state = _setup()
    fleet.agent_engine("b", _engine(("sql",)))
    fleet.agent_engine("c", _engine(()))
    feats = RequestFeatures("m", [1, 2], prompt_tokens=40, block_size=16, lora="sql")
    for _ in range(6):
        assert router.choose(state, feats).record.id == "b"
    base = RequestFeatures("m", [1, 2], prompt_tokens=40, block_size=16)
    assert {router.choose(state, base).record.id for _ in range(6)} == {"a", "b", "c"}
    # the holder unhealthy or already tried: the fallback ('any') takes every replica of the model
    assert router.decide(state, feats, router.match(feats), frozenset({"b"})).record.id in {"a", "c"}
    fleet.check_result("b", False)
    fleet.check_result("b", False)
    fleet.check_result("b", False)
    assert router.decide(state, feats, router.match(feats)).record.id in {"a", "c"}
    # the adapter set follows the engine: unloaded from b, loaded on c
    fleet.check_result("b", True)
    fleet.check_result("b", True)
    fleet.agent_engine("b", _engine(()))
    fleet.agent_engine("c", _engine(("sql", "other")))
    for _ in range(4):
        assert router.choose(state, feats).record.id == "c"


def test_lora_fallback_none_refuses_when_no_holder_is_healthy() -> None:
    fleet, _, router, state = _setup(fallback="none")
    feats = RequestFeatures("m", [1], prompt_tokens=20, block_size=16, lora="sql")
    with pytest.raises(NoReplicaError):
        router.decide(state, feats, router.match(feats))
    fleet.agent_engine("a", _engine(("sql",)))
    assert router.decide(state, feats, router.match(feats)).record.id == "a"
    with pytest.raises(NoReplicaError):
        router.decide(state, feats, router.match(feats), frozenset({"a"}))


def test_a_hybrid_replica_is_matched_by_its_deepest_key_and_speculates_only_the_last_block() -> None:
    fleet, index, router, state = _setup(policy="kv_aware")
    for r in ("b", "c"):
        fleet.check_result(r, False)
        fleet.check_result(r, False)
        fleet.check_result(r, False)
    feats = RequestFeatures("m", [11, 12, 13], prompt_tokens=60, block_size=16)
    router.choose(state, feats)
    assert index.approximate_keys("a") == [13, 12, 11]  # plain: the whole prompt
    fleet.agent_engine("a", _engine(hybrid=True))
    rec = fleet.get("a")
    assert rec is not None and rec.identity.hybrid and rec.identity.adapters is None
    assert index.is_hybrid("a") and index.approximate_keys("a") == []  # recorded as plain: dropped
    choice = router.choose(state, feats)
    assert choice.predicted_tokens == 0 and index.approximate_keys("a") == [13]
    # the same prompt again: the bound is (60 - 1) // 16 = 3 blocks; its deepest key within it is 13
    assert router.choose(state, feats).predicted_tokens == 48
    # a request sharing the first blocks but not the last: no hit on a hybrid engine
    other = RequestFeatures("m", [11, 12, 21, 22], prompt_tokens=70, block_size=16)
    assert router.decide(state, other, router.match(other)).predicted_tokens == 0
    # a continuation (next turn) hits the last block of the earlier prompt
    longer = RequestFeatures("m", [11, 12, 13, 14], prompt_tokens=70, block_size=16)
    assert router.decide(state, longer, router.match(longer)).predicted_tokens == 48
    # a precise key beyond the bound of a prompt that ends on a block boundary is not a hit
    index.store("a", [31, 32])
    exact = RequestFeatures("m", [31, 32], prompt_tokens=32, block_size=16)
    assert router.decide(state, exact, router.match(exact)).predicted_tokens == 16
