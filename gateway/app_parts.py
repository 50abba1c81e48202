"""The builders the composition root (``gateway/app.py``) calls: the routing state of a config
(policy and featurizer, the featurizer kept across a reload that does not change its inputs), the
agents' gRPC server, and the shared-state parts (docs/architecture.md, "Config"; docs/shared-state.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry

from gateway.agent_credentials import stream_access_of
from gateway.config import GatewayConfig
from gateway.features import Featurizer
from gateway.features.remote_tokenizer import UrlChooser
from gateway.fleet import Fleet
from gateway.inventory_server import InventoryServer, InventorySettings
from gateway.routing import RoutingState
from gateway.shared_state import SharedState
from gateway.shared_state_context import SharedContext
from gateway.shared_state_follower import Follower
from gateway.shared_state_load import LoadExchange
from gateway.shared_state_publisher import Publisher
from router_policies.prefix_index import PrefixIndex
from router_policies.registry import build_policy


def _featurizer_inputs(config: GatewayConfig) -> tuple[object, ...]:
    """What a featurizer is built from: a reload that keeps these keeps the featurizer (and its
    warm tokenization cache)."""
    p = config.proxy
    return (
        config.models,
        p.tokenize_cache_entries,
        p.tokenize_threads,
        p.tokenize_offload_chars,
        p.tokenize_defer_chars,
        p.tokenize_seen_entries,
        p.tokenize_defer_backlog_chars,
        p.tokenize_defer_quiet_s,
        p.tokenize_defer_max_wait_s,
        p.tokenize_cache_bytes,
        p.tokenize_checkpoint_bytes,
        p.tokenize_defer_backlog_bytes,
        p.tokenize_inflight_bytes,
        p.max_prompt_chars,
        p.memo_cache_bytes,
    )


def build_state(
    config: GatewayConfig,
    remote: UrlChooser | None = None,
    previous: RoutingState | None = None,
) -> RoutingState:
    """The policy and featurizer for ``config`` (raises ``UserInputError`` subclasses)."""
    policy = build_policy(config.policy.name, config.policy.params_for(), seed=config.policy.seed)
    if previous is not None and _featurizer_inputs(previous.config) == _featurizer_inputs(config):
        featurizer = previous.featurizer
    else:
        featurizer = Featurizer.from_config(config, remote=remote)
    return RoutingState(config=config, policy=policy, featurizer=featurizer)


def wire_shared_state(
    config: GatewayConfig,
    index: PrefixIndex,
    fleet: Fleet,
    inventory: InventoryServer,
    registry: CollectorRegistry,
    instance_id: str | None = None,
) -> SharedState:
    """The shared-state parts (docs/shared-state.md), each the one writer of its state: the
    publisher observes the inventory server, the follower writes the replicas owned elsewhere
    (and stops the moment an agent for one connects here), the load exchange feeds the fleet."""
    ctx = SharedContext.create(config.shared_state, registry, instance_id)
    follower = Follower(ctx, index, fleet, inventory)
    publisher = Publisher(ctx, inventory, index.config.max_replicas, on_owned=follower.stop_following)
    inventory.observer = publisher
    return SharedState(ctx, publisher, follower, LoadExchange(ctx, fleet, inventory))


def build_inventory_server(
    config: GatewayConfig,
    env: Mapping[str, str],
    index: PrefixIndex,
    fleet: Fleet,
    registry: CollectorRegistry,
    configured: Callable[[], set[str]],
) -> InventoryServer:
    """The agents' gRPC server as the config sets it (``configured``: the config's replica ids)."""
    return InventoryServer(
        index,
        fleet,
        token=None,
        access=stream_access_of(config, env, configured),
        registry=registry,
        settings=InventorySettings(
            block_bound_factor=config.inventory.block_bound_factor,
            ack_every=config.inventory.ack_every,
            ack_interval_s=config.inventory.ack_interval_s,
            tls_cert=config.inventory.tls_cert,
            tls_key=config.inventory.tls_key,
        ),
    )


def env_token(name: str | None, env: Mapping[str, str]) -> str | None:
    return (env.get(name) or None) if name else None
