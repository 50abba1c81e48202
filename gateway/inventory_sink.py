"""What the inventory server tells the rest of the gateway about agents (the fleet implements it).

Kept free of grpc so that the fleet and its tests can import it cheaply. Every method is called
from the event loop that runs the inventory server and must not block or await.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class AgentHello:
    """An agent's Hello, as received (docs/architecture.md, the inventory path)."""

    replica_id: str
    url: str
    models: tuple[str, ...]
    block_size: int
    capacity_blocks: int  # 0 when the engine did not say
    engine: str
    engine_version: str
    agent_version: str


@dataclass(frozen=True, slots=True)
class AgentLoad:
    """The engine's own load figures, from its /metrics, as the agent last read them."""

    running: int
    waiting: int
    kv_usage: float  # 0..1
    prefix_queries: int  # counters, in tokens (0 when the engine has none)
    prefix_hits: int


@dataclass(frozen=True, slots=True)
class AgentEngine:
    """What the agent last said of its engine (EngineState): hybrid KV-cache groups, and the
    LoRA adapters it has loaded (``adapters_known`` false: the engine does not list them)."""

    hybrid: bool
    lora_adapters: frozenset[str]
    adapters_known: bool


class FleetSink(Protocol):
    def agent_hello(self, hello: AgentHello) -> str | None:
        """Accept the agent of ``hello.replica_id`` (register the replica if allowed).

        The fleet owns the replica set: an accepted replica is tracked by the prefix index when
        this returns (the inventory server never adds one itself). Return None to accept, or a
        message to refuse the stream: an unknown replica when registration is off, a block size
        the gateway cannot use, the index's max_replicas reached, ..."""
        ...

    def agent_load(self, replica_id: str, load: AgentLoad) -> None: ...

    def agent_engine(self, replica_id: str, engine: AgentEngine) -> None:
        """The agent's EngineState: how the replica's keys match, which adapters it serves."""
        ...

    def key_block_size(self, models: Iterable[str]) -> int:
        """The block size the gateway keys the first of ``models`` it serves at (0: none). Sent
        on the Ack of the Hello, so that an agent keying a smaller engine page re-keys."""
        ...

    def snapshot_keep(self) -> tuple[float, float]:
        """(now, lifetime_s) on the clock of the index's speculative entries: the precise entries
        a replica's snapshot drops are kept that long as speculative ones
        (``placement.replace_snapshot``; docs/agent.md, "Recovery without replay")."""
        ...

    def agent_state(self, replica_id: str, *, connected: bool, degraded: bool) -> None:
        """The replica's agent stream connected or went away, or its inventory became (in)complete.

        ``degraded`` is true while the index may miss blocks of the replica: before its first
        snapshot is applied, and while the agent reports an unrecoverable event gap."""
        ...
