"""How an inventory stream is refused (docs/architecture.md, "One inventory message"): one
exception carrying the gRPC status and the metric's reason, and the checks that raise it outside
one message's handling."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from gateway.inventory_sink import AgentEngine
from proto.contract import MAX_LORA_ADAPTERS
from proto.kvgate.v1 import inventory_pb2 as pb

if TYPE_CHECKING:
    from gateway.inventory_stream import StreamState


class Refusal(Exception):
    """End the stream with ``code``; ``reason`` is the metric label."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


def malformed(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.INVALID_ARGUMENT, "malformed", message)


def protocol(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.INVALID_ARGUMENT, "protocol", message)


def over_bound(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "block_bound", message)


def check_keyed_at(stream: StreamState) -> None:
    """Keys cover ``keyed_at`` tokens; the gateway's cover ``key_block_size``. Keys of another size
    would never match a request, so they are refused rather than applied (an agent re-keys at the
    size the Ack of its Hello gave, then says Hello again; an agent too old to re-key is told why)."""
    if stream.key_block_size and stream.keyed_at != stream.key_block_size:
        raise Refusal(
            grpc.StatusCode.FAILED_PRECONDITION,
            "block_size",
            f"replica {stream.replica!r}: the agent keys blocks of {stream.keyed_at} tokens, the gateway "
            f"keys this model at {stream.key_block_size}: re-key at {stream.key_block_size} "
            "(agents re-key on the Ack of their Hello; or start the agent with --key-block-size)",
        )


def engine_of(st: pb.EngineState) -> AgentEngine:
    """An EngineState as the fleet takes it (refused when it lists too many adapters)."""
    if len(st.lora_adapters) > MAX_LORA_ADAPTERS:
        raise malformed(f"engine state lists {len(st.lora_adapters)} adapters, over {MAX_LORA_ADAPTERS}")
    return AgentEngine(st.hybrid, frozenset(st.lora_adapters), st.adapters_known)
