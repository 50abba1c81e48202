"""The gateway's held-prefix hints over real gRPC (docs/agent.md, "Recovery without replay"):
sent only to a replica whose agent reports its inventory degraded, in order, never otherwise."""

from __future__ import annotations

import asyncio

import grpc.aio

from proto.kvgate.v1 import inventory_pb2 as pb
from tests.integration.test_inventory_server import Rig, establish, read_until_ack, rig

__all__ = ["rig"]  # the fixture


def state(seq: int, degraded: bool) -> pb.AgentMessage:
    return pb.AgentMessage(seq=seq, state=pb.AgentState(degraded=degraded, reason="test"))


async def next_held(call: grpc.aio.StreamStreamCall) -> pb.HeldPrefix:
    while True:
        msg = await asyncio.wait_for(call.read(), 5)
        assert msg is not grpc.aio.EOF
        assert isinstance(msg, pb.GatewayMessage)
        if msg.WhichOneof("body") == "held":
            return msg.held


async def test_hints_only_while_degraded(rig: Rig) -> None:
    assert rig.server.held_prefix("r0", [1], [5] * 16) is False  # no stream
    call = await establish(rig)
    assert rig.server.held_prefix("r0", [1, 2], [5] * 16) is False  # not degraded: nothing sent
    await call.write(state(3, True))
    await read_until_ack(call, 3)
    assert rig.server.held_prefix("r0", [1, 2], [5] * 16) is True
    assert rig.server.held_prefix("r0", [7], [6] * 16) is True
    first, second = await next_held(call), await next_held(call)
    assert (list(first.keys), list(first.next_tokens)) == ([1, 2], [5] * 16)
    assert (list(second.keys), list(second.next_tokens)) == ([7], [6] * 16)
    await call.write(state(4, False))
    await read_until_ack(call, 4)
    assert rig.server.held_prefix("r0", [1, 2], [5] * 16) is False
    assert rig.server.held_prefix("r1", [1, 2], [5] * 16) is False  # another replica's: no stream
    await call.done_writing()
