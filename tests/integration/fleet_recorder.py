"""The real ``gateway.fleet.Fleet`` for inventory-server tests, recording what the server told it.

The fleet owns the replica set (it registers an accepted replica with the index), so the inventory
tests use it rather than a stand-in; the recorded calls let a test check what the server said.
"""

from __future__ import annotations

from gateway.config import parse_config
from gateway.fleet import Fleet
from gateway.inventory_sink import AgentHello, AgentLoad
from router_policies.prefix_index import PrefixIndex


class RecordingFleet(Fleet):
    """Knows replicas ``replicas`` (static, registration off) serving model ``m`` with gateway
    block size ``block_size``."""

    def __init__(
        self, index: PrefixIndex, replicas: tuple[str, ...] = ("r0", "r1"), block_size: int = 16
    ) -> None:
        config = parse_config(
            {
                "models": [{"name": "m", "block_size": block_size}],
                "replicas": [{"id": r, "url": "http://127.0.0.1:9", "models": ["m"]} for r in replicas],
                "inventory": {"allow_registration": False},
            }
        )
        super().__init__(config, index)
        self.hellos: list[AgentHello] = []
        self.loads: list[tuple[str, AgentLoad]] = []
        self.states: list[tuple[str, bool, bool]] = []

    def agent_hello(self, hello: AgentHello) -> str | None:
        self.hellos.append(hello)
        return super().agent_hello(hello)

    def agent_load(self, replica_id: str, load: AgentLoad) -> None:
        self.loads.append((replica_id, load))
        super().agent_load(replica_id, load)

    def agent_state(self, replica_id: str, *, connected: bool, degraded: bool) -> None:
        self.states.append((replica_id, connected, degraded))
        super().agent_state(replica_id, connected=connected, degraded=degraded)
