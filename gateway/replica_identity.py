"""What a replica is and where its blocks are reported from (docs/architecture.md, "Fleet").

Both values are immutable; ``Fleet`` is their only writer and replaces them whole: the identity
on a config reload or an agent's hello, the link when an agent stream comes or goes or the shared
state starts or stops following the replica.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaIdentity:
    id: str
    url: str
    models: frozenset[str]  # empty: every configured model
    static: bool  # listed in the config (else registered by its agent)
    engine: str = ""  # "<engine> <version>" from the agent's hello
    block_size: int | None = None  # the engine's, from the agent's hello
    # from the agent's EngineState: several KV-cache groups (matched by the deepest key), and the
    # LoRA adapters the engine has loaded (None: not known, the engine does not list them)
    hybrid: bool = False
    adapters: frozenset[str] | None = None

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models

    def has_adapter(self, lora: str) -> bool:
        """The engine reported ``lora`` among its loaded adapters."""
        return self.adapters is not None and lora in self.adapters


@dataclass(frozen=True, slots=True)
class AgentLink:
    connected: bool = False  # an agent streams this replica's inventory to this gateway
    degraded: bool = False  # the agent says the index may miss some of its blocks
    shared: bool = False  # another gateway instance hears its agent and shares it through Redis

    @property
    def reported(self) -> bool:
        """An agent reports the replica's blocks, here or through the shared state."""
        return self.connected or self.shared
