"""Decoding of the KV-cache events vLLM and SGLang publish over ZMQ (docs/architecture.md, the
agent; docs/agent.md "SGLang" for the versions checked).

Wire format (checked against vllm/distributed/kv_events.py and bytes recorded from a real vLLM,
and against bytes SGLang 0.5.10, 0.5.19 and 0.5.23's own radix cache and publisher produced,
tests/data/sglang_events/):

* frames ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian counter per publisher;
* ``payload`` is msgpack of an EventBatch: an array ``[ts, events]`` or ``[ts, events, dp_rank]``
  (SGLang: ``[ts, events, attn_dp_rank]``; older vLLM and vLLM 0.32 as observed), or a map
  ``{"ts", "events", "data_parallel_rank"}`` (a msgspec Struct without ``array_like``);
* each event is a map with a ``type`` key (current vLLM; SGLang >= 0.5.20) or a tagged array whose
  first item is the type name (older vLLM; SGLang <= 0.5.19), with fields in declaration order:
  ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, then
  vLLM: lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, ...; SGLang 0.5.19 (``BlockStoredWithMetadata``, salted
  requests only): a map ``{"cache_salt": ...}`` in the place of vLLM's lora_name.
  ``BlockRemoved``: block_hashes, medium, group_idx (hybrid models: one group per attention type);
  ``AllBlocksCleared``: nothing. Trailing
  fields with defaults may be omitted (``omit_defaults``). SGLang's map events name
  ``cache_salt`` (>= 0.5.20), ``session_id`` and ``lora_name`` (>= 0.5.22) as fields.
* block hashes are ints (vLLM: unsigned 64-bit; SGLang: signed 64-bit) or byte digests (vLLM with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). They are only ever compared with each other, so both
  are kept as the Python value msgpack gives (int or bytes).
* SGLang publishes one BlockStored per page (``block_size = len(page)``: a partial last page has
  a smaller one and is not keyed); >= 0.5.19 merges a node's consecutive pages into one event.
  With EAGLE its token ids are ``[token, next token]`` bigrams: keyed by their first tokens.

The cache salt of a request's first block: SGLang's ``cache_salt`` field or metadata map; vLLM
carries it in ``extra_keys`` (per block, ``lora_name`` first, then multimodal identifiers, then
``cache_salt`` on the first block only, then prompt-embedding hashes), so there it is the first
block's last ``str`` extra key that is not the LoRA name. Multimodal requests are not keyed
faithfully (their placeholder tokens hide the image), which matches the gateway, which does not
see the image either.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import NoneType
from typing import Any

import msgpack

EngineHash = int | bytes


class MalformedEvent(ValueError):
    """A payload or event that does not decode; the caller counts and skips it."""


# eq=False: events are compared by identity, as before; repr=False: the short repr below
@dataclass(slots=True, eq=False, repr=False)
class BlockStored:
    block_hashes: list[EngineHash]
    parent: EngineHash | None
    token_ids: list[int]
    block_size: int
    medium: str
    lora_name: str | None
    cache_salt: str | None
    # vLLM's KV-cache group (hybrid models: one per attention type), its spec kind
    # ("full_attention", "sliding_window", "mamba", ...) and sliding window in tokens
    group: int | None = None
    spec_kind: str | None = None
    window: int | None = None

    def __repr__(self) -> str:
        return (
            f"BlockStored({len(self.block_hashes)} blocks, parent={self.parent!r}, "
            f"block_size={self.block_size}, medium={self.medium!r}, lora={self.lora_name!r}, "
            f"salt={self.cache_salt!r})"
        )


@dataclass(slots=True, eq=False, repr=False)
class BlockRemoved:
    block_hashes: list[EngineHash]
    medium: str | None
    group: int | None = None

    def __repr__(self) -> str:
        return f"BlockRemoved({self.block_hashes!r}, medium={self.medium!r})"


class AllBlocksCleared:
    __slots__ = ()

    def __repr__(self) -> str:
        return "AllBlocksCleared()"


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared

# The fields of vLLM's BlockStored, in the order of its array form (msgspec ``array_like``): what
# every version sends (SGLang the first ones), then what newer vLLM versions add.
BASE_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
_STORED_FIELDS = (*BASE_STORED_FIELDS, "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")


def _hashes(value: Any, what: str) -> list[EngineHash]:
    if not isinstance(value, list):
        raise MalformedEvent(f"{what}: block_hashes must be a list, got {type(value).__name__}")
    for h in value:
        if not isinstance(h, int | bytes) or isinstance(h, bool):
            raise MalformedEvent(f"{what}: block hash of type {type(h).__name__}")
    return value


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _salt(extra_keys: Any, lora_name: str | None) -> str | None:
    """The cache salt of a request's first block, from that block's extra keys."""
    if not isinstance(extra_keys, list) or not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, list | tuple):
        return None
    items = list(first)
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    for item in reversed(items):
        if isinstance(item, str):
            return item
    return None


def _stored(f: dict[str, Any]) -> BlockStored:
    hashes = _hashes(f.get("block_hashes"), "BlockStored")
    parent = f.get("parent_block_hash")
    if parent is not None and (not isinstance(parent, int | bytes) or isinstance(parent, bool)):
        raise MalformedEvent(f"BlockStored: parent_block_hash of type {type(parent).__name__}")
    tokens = f.get("token_ids")
    if not isinstance(tokens, list):
        raise MalformedEvent("BlockStored: token_ids must be a list")
    if tokens and type(tokens[0]) is list:
        # SGLang with EAGLE speculative decoding: its tree holds bigrams, a page of [token, next
        # token] pairs; the KV at each position is the first token's
        tokens = [t[0] if type(t) is list and t else t for t in tokens]
    block_size = f.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise MalformedEvent(f"BlockStored: bad block_size {block_size!r}")
    medium = f.get("medium")
    lora_name = f.get("lora_name")
    metadata = f.get("metadata")
    if isinstance(lora_name, dict):
        # SGLang 0.5.19's BlockStoredWithMetadata: the array's 8th field is a metadata map, in the
        # place where vLLM puts lora_name
        metadata, lora_name = lora_name, None
    lora_name = _opt_str(lora_name)
    salt: str | None = None
    if parent is None:
        # SGLang >= 0.5.20 (maps): a cache_salt field; 0.5.19: metadata {"cache_salt"};
        # vLLM: the first block's extra keys
        salt = _opt_str(f.get("cache_salt"))
        if salt is None and isinstance(metadata, dict):
            salt = _opt_str(metadata.get("cache_salt"))
        if salt is None:
            salt = _salt(f.get("extra_keys"), lora_name)
    return BlockStored(
        hashes,
        parent,
        tokens,
        block_size,
        medium if isinstance(medium, str) and medium else "GPU",
        lora_name,
        salt,
        _opt_int(f.get("group_idx")),
        _opt_str(f.get("kv_cache_spec_kind")),
        _opt_int(f.get("kv_cache_spec_sliding_window")),
    )


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _removed(f: dict[str, Any]) -> BlockRemoved:
    medium = f.get("medium")
    return BlockRemoved(
        _hashes(f.get("block_hashes"), "BlockRemoved"),
        medium if isinstance(medium, str) else None,
        _opt_int(f.get("group_idx")),
    )


def decode_event(raw: Any) -> EngineEvent:
    """One event, map-encoded or tagged-array-encoded."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        if kind == "BlockStored":
            fields = dict(zip(_STORED_FIELDS, raw[1:], strict=False))
        elif kind == "BlockRemoved":
            fields = dict(zip(_REMOVED_FIELDS, raw[1:], strict=False))
        else:
            fields = {}
    else:
        raise MalformedEvent(f"event is neither a map nor a tagged array: {type(raw).__name__}")
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        return _removed(fields)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise MalformedEvent(f"unknown event type {kind!r}")


@dataclass(slots=True, eq=False)
class EventBatch:
    ts: float
    events: list[EngineEvent]
    malformed: int  # events of the batch that did not decode (skipped)


def decode_payload(payload: bytes) -> EventBatch:
    """A batch of events. A payload that is not an EventBatch raises ``MalformedEvent``; single
    events that do not decode are skipped and counted in ``EventBatch.malformed``."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise MalformedEvent(f"payload is not msgpack: {exc}") from None
    if isinstance(obj, list) and len(obj) >= 2:
        ts, raw_events = obj[0], obj[1]
    elif isinstance(obj, dict):
        ts, raw_events = obj.get("ts", 0.0), obj.get("events")
    else:
        raise MalformedEvent("payload is not an event batch")
    if not isinstance(raw_events, list):
        raise MalformedEvent("payload events is not a list")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        ts = 0.0
    events: list[EngineEvent] = []
    malformed = 0
    last_removed: BlockRemoved | None = None
    for raw in raw_events:
        # fast path: vLLM sends one BlockRemoved per block; adjacent removals of one medium are
        # merged into one event (same order of effects, one call down the line instead of many)
        if type(raw) is dict and raw.get("type") == "BlockRemoved":
            hashes = raw.get("block_hashes")
            medium = raw.get("medium")
            group = raw.get("group_idx")
            if (
                type(hashes) is list
                and (medium is None or type(medium) is str)
                and type(group) in (int, NoneType)
            ):
                for h in hashes:
                    t = type(h)
                    if t is not int and t is not bytes:
                        break
                else:
                    if (
                        last_removed is not None
                        and last_removed.medium == medium
                        and last_removed.group == group
                    ):
                        last_removed.block_hashes.extend(hashes)
                    else:
                        last_removed = BlockRemoved(hashes, medium, group)
                        events.append(last_removed)
                    continue
        try:
            ev = decode_event(raw)
        except MalformedEvent:
            malformed += 1
            continue
        if type(ev) is BlockRemoved:
            if last_removed is not None and (last_removed.medium, last_removed.group) == (
                ev.medium,
                ev.group,
            ):
                last_removed.block_hashes.extend(ev.block_hashes)
                continue
            last_removed = ev
        else:
            last_removed = None
        events.append(ev)
    return EventBatch(float(ts), events, malformed)


def parse_seq(raw: bytes) -> int:
    """A batch's seq frame: 8 bytes, big-endian, signed (replay ends with -1)."""
    if len(raw) != 8:
        raise MalformedEvent(f"seq frame of {len(raw)} bytes, expected 8")
    return int.from_bytes(raw, "big", signed=True)
