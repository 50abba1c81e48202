"""What the agent and the gateway agree on beside the messages of proto/kvgate/v1/inventory.proto
(docs/architecture.md, the inventory stream): the protocol version a Hello carries, the medium an
empty ``medium`` field stands for, and the method's name. Both sides import these from here only.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
"""The version an agent's Hello carries; the gateway also accepts 0 (agents older than the field)."""

GPU = "GPU"
"""The medium of a block whose ``medium`` field is empty (the common case travels as no bytes)."""

MAX_LORA_ADAPTERS = 4096
"""The most adapter names one EngineState may list (a longer list is refused as malformed)."""

SERVICE = "kvgate.v1.Inventory"
METHOD = "Sync"


def medium_of(wire: str) -> str:
    """The medium a received ``medium`` field names."""
    return wire or GPU


def wire_medium(medium: str) -> str:
    """The ``medium`` field to send for ``medium`` (empty for GPU)."""
    return "" if medium == GPU else medium
