"""The abusive inventory streams (docs/architecture.md, section 4; docs/faults.md; docs/gateway.md,
"Agent credentials"): one table, played against an in-process inventory server by
tests/integration/test_inventory_abuse.py and against a real ``kvgate serve`` by ``make faults``
(kvgate_tools/faults/inventory_faults.py).

The fleet both build: static r0 and r1 with tokens of their own, an agent-registered a0 at
``A0_URL`` (its token's hash in a file), a shared token, registration allowed at
http://10.0.0.*:8000 and in 192.168.0.0/16.
"""

from __future__ import annotations

import grpc

from kvgate_tools.stream_agent import events, hello, load, snap, stored
from proto.kvgate.v1 import inventory_pb2 as pb

TOKENS = {"r0": "tok-r0", "r1": "tok-r1", "a0": "tok-a0", "shared": "tok-shared"}
A0_URL = "http://10.0.0.5:8000"


def bearer(who: str) -> str:
    return f"Bearer {TOKENS[who]}"


_P = grpc.StatusCode.PERMISSION_DENIED
_I = grpc.StatusCode.INVALID_ARGUMENT
_U = grpc.StatusCode.UNAUTHENTICATED
_F = grpc.StatusCode.FAILED_PRECONDITION

# (name, token, messages, expected status, refusal metric reason)
CASES: list[tuple[str, str | None, list[pb.AgentMessage | bytes], grpc.StatusCode, str]] = [
    ("no token", None, [hello("r0"), snap(2, [99])], _U, "auth"),
    ("wrong token", "Bearer nope", [hello("r0"), snap(2, [99])], _U, "auth"),
    ("token without Bearer", TOKENS["r0"], [hello("r0"), snap(2, [99])], _U, "auth"),
    ("r0's token as r1", bearer("r0"), [hello("r1"), snap(2, [99])], _P, "identity"),
    ("r0's token as agent-registered a0", bearer("r0"), [hello("a0", A0_URL), snap(2, [99])], _P, "identity"),
    ("a0's token (file) as r0", bearer("a0"), [hello("r0"), snap(2, [99])], _P, "identity"),
    ("shared token as r0 (has its own)", bearer("shared"), [hello("r0"), snap(2, [99])], _P, "identity"),
    ("shared token as a0, moving its URL", bearer("shared"), [hello("a0", "http://10.0.0.6:8000")], _P, "identity"),
    ("r0's token registering a new id", bearer("r0"), [hello("n1", "http://10.0.0.7:8000")], _P, "identity"),
    ("new replica at an arbitrary URL", bearer("shared"), [hello("n1", "http://evil.example:8000")], _P, "registration"),
    ("pattern label spoof", bearer("shared"), [hello("n1", "http://10.0.0.5.evil.com:8000")], _P, "registration"),
    ("user info spoof", bearer("shared"), [hello("n1", "http://10.0.0.1@evil.com:8000")], _P, "registration"),
    ("allowed host, other port", bearer("shared"), [hello("n1", "http://10.0.0.7:9999")], _P, "registration"),
    ("outside the CIDR", bearer("shared"), [hello("n1", "http://192.169.0.1:8000")], _P, "registration"),
    ("a0 moving itself to an arbitrary URL", bearer("a0"), [hello("a0", "http://evil.example:8000")], _P, "registration"),
    ("garbage bytes", bearer("r0"), [b"\xff\xff\xff"], _I, "malformed"),
    ("events before hello", bearer("r0"), [events(1, stored(99))], _I, "protocol"),
    ("hello with seq 5", bearer("r0"), [hello("r0", seq=5)], _I, "protocol"),
    ("empty replica id", bearer("shared"), [hello("")], _I, "malformed"),
    ("second hello as another replica", bearer("r1"), [hello("r1"), hello("r0", seq=2)], _I, "protocol"),
    ("load with a NaN KV usage", bearer("r0"), [hello("r0"), load(2, float("nan"))], _I, "protocol"),
    ("load with a KV usage over 1", bearer("r0"), [hello("r0"), load(2, 1.5)], _I, "protocol"),
    ("block size mismatch", bearer("r0"), [hello("r0", block_size=5), snap(2, [99])], _F, "hello_refused"),
    ("keys at a divisor, not re-keyed", bearer("r0"), [hello("r0", block_size=8), snap(2, [99])], _F, "block_size"),
    ("protocol version 99", bearer("r0"), [hello("r0", version=99), snap(2, [99])], _F, "protocol"),
    ("snapshot over its bound", bearer("r1"), [hello("r1", capacity=1), snap(2, list(range(100, 200)))],
     grpc.StatusCode.RESOURCE_EXHAUSTED, "block_bound"),
]  # fmt: skip
