"""Inventory operations (docs/architecture.md, the inventory path): the one decoder of an agent's
events into ops, and the one ``apply_ops`` that every reader of inventory changes goes through.

An op is what changed in one replica's cache: ``s`` stored keys (in a medium), ``r`` removed keys,
``c`` cleared. The same ops are applied to three kinds of target (``OpTarget``):

* ``IndexReplica``: one replica of the prefix index (the owner's inventory server, and the
  shared-state follower applying another instance's deltas);
* ``Staging``: a snapshot being received in chunks (deltas that arrive meanwhile apply to it);
* ``BoundCheck``: a count of the replica's blocks, replayed before a batch near a bound is applied,
  so that a batch over the bound is refused whole.

Invariants
* Decoding is complete before anything is applied: a malformed batch raises ``MalformedOps`` and
  no target has seen any of it.
* ``apply_ops`` never awaits; a target raises (``BoundExceeded``, ``IndexBoundError``) to stop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from proto.contract import GPU, medium_of
from proto.kvgate.v1 import inventory_pb2 as pb
from router_policies.prefix_index import PrefixIndex

OpKind = Literal["s", "r", "c"]


@dataclass(frozen=True, slots=True)
class Op:
    kind: OpKind
    keys: Sequence[int] = ()
    medium: str = GPU


class MalformedOps(ValueError):
    """An agent's batch that does not decode into ops (an event without a kind)."""


class BoundExceeded(Exception):
    """Applying the ops would take a replica (or the index) over its block bound."""


def ops_of_events(events: Iterable[pb.Event]) -> list[Op]:
    """An agent's event batch as ops; raises ``MalformedOps`` on an event without a kind."""
    out: list[Op] = []
    for ev in events:
        which = ev.WhichOneof("kind")
        if which == "stored":
            out.append(Op("s", list(ev.stored.keys), medium_of(ev.stored.medium)))
        elif which == "removed":
            out.append(Op("r", list(ev.removed.keys)))
        elif which == "cleared":
            out.append(Op("c"))
        else:
            raise MalformedOps("Event without a kind")
    return out


def op_of_chunk(chunk: pb.SnapshotChunk) -> Op:
    """A snapshot chunk's keys, as the store op they amount to."""
    return Op("s", list(chunk.keys), medium_of(chunk.medium))


# The largest agent message the inventory stream accepts (its gRPC receive limit). A message's
# ops relayed as one frame (to the workers, ``gateway.local_hub``) take at most 9/4 of its bytes
# plus the frame's header: a key is 8 bytes in both (fixed64), a medium's name given as many, and
# an op's own bytes at most 9/4 of its event's in the message. The worst is an empty store of
# the default medium: 4 bytes there (the event's and the store's tags and lengths), 9 here (kind,
# the medium's length and "GPU", a 4-byte count); an empty removal is 4 there and 5 here, a clear
# 4 and 1. OPS_FRAME_EXPANSION rounds that up (tests/unit/test_invariants_gateway_state.py sends
# each of these shapes).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
OPS_FRAME_EXPANSION = 3


def stored_keys(ops: Iterable[Op]) -> int:
    """How many keys the ops store (an upper bound of how much they grow a replica)."""
    return sum(len(op.keys) for op in ops if op.kind == "s")


class OpTarget(Protocol):
    """Something that holds one replica's precise blocks. Must not await."""

    def store(self, keys: Sequence[int], medium: str) -> None: ...

    def remove(self, keys: Sequence[int]) -> int:
        """Forget ``keys``; returns how many were held."""
        ...

    def clear(self) -> None: ...


def apply_ops(ops: Iterable[Op], target: OpTarget) -> None:
    """Apply ``ops`` in order to ``target``."""
    for op in ops:
        if op.kind == "s":
            target.store(op.keys, op.medium)
        elif op.kind == "r":
            target.remove(op.keys)
        else:
            target.clear()


@dataclass(slots=True)
class IndexReplica:
    """One replica of the prefix index as an ``OpTarget``, counting what it applied (the counts
    stay right when a bound error stops the ops part-way)."""

    index: PrefixIndex
    replica: str
    stored: int = 0  # keys in store ops applied
    removed: int = 0  # entries removed
    cleared: int = 0  # clear ops applied

    def store(self, keys: Sequence[int], medium: str) -> None:
        self.index.store(self.replica, keys, medium)
        self.stored += len(keys)

    def remove(self, keys: Sequence[int]) -> int:
        n = self.index.remove(self.replica, keys)
        self.removed += n
        return n

    def clear(self) -> None:
        self.index.clear_replica(self.replica)
        self.cleared += 1


@dataclass(slots=True)
class Staging:
    """A snapshot being received: ``key -> medium``, at most ``bound`` keys.

    Chunks overwrite (the snapshot says where each block is); stored events keep a key's first
    medium, as the index does for a key it already holds."""

    snapshot_id: int
    bound: int
    entries: dict[int, str] = field(default_factory=dict)

    def add_chunk(self, op: Op) -> None:
        entries = self.entries
        for k in op.keys:
            entries[k] = op.medium
        self.check()

    def store(self, keys: Sequence[int], medium: str) -> None:
        entries = self.entries
        for k in keys:
            entries.setdefault(k, medium)

    def remove(self, keys: Sequence[int]) -> int:
        entries = self.entries
        return sum(1 for k in keys if entries.pop(k, None) is not None)

    def clear(self) -> None:
        self.entries.clear()

    def check(self) -> None:
        if len(self.entries) > self.bound:
            raise BoundExceeded(f"exceeds its bound of {self.bound} blocks")


@dataclass(slots=True)
class BoundCheck:
    """A count of a replica's blocks that refuses any store taking it over ``bound``, or the index
    over ``limit_total`` (counting the replica's blocks on top of ``base_total``: conservative)."""

    held: set[int]
    bound: int
    base_total: int
    limit_total: int

    @classmethod
    def of(cls, index: PrefixIndex, replica: str, bound: int) -> BoundCheck:
        held = set(index.precise_keys(replica))
        return cls(held, bound, index.entries - len(held), index.config.max_total_blocks)

    def store(self, keys: Sequence[int], _medium: str) -> None:
        self.held.update(keys)
        count = len(self.held)
        if count > self.bound:
            raise BoundExceeded(f"would hold {count} blocks, over its bound of {self.bound}")
        if self.base_total + count > self.limit_total:
            raise BoundExceeded(f"would take the index over max_total_blocks={self.limit_total}")

    def remove(self, keys: Sequence[int]) -> int:
        before = len(self.held)
        self.held.difference_update(keys)
        return before - len(self.held)

    def clear(self) -> None:
        self.held.clear()
