"""The harness's own view of an engine's KV events: a ZMQ SUB tap that records raw frames, a
replay client, a decoder for both event encodings, and an independent reconstruction of the set
of blocks the engine holds, keyed with kvgate's block-key contract.

This deliberately shares no code with ``replica_agent``: it exists to check the agent and the
gateway against the engine, so it re-derives everything from the frames and from
``router_policies.block_keys`` (the contract both sides must follow), nothing else.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from router_policies.block_keys import chain_keys, root_key

EngineHash = int | bytes


@dataclass(frozen=True)
class Frame:
    topic: bytes
    seq: int  # signed: the replay end marker carries -1
    payload: bytes
    received_at: float  # time.monotonic() when the tap read it (0.0 for replayed frames)


def _seq(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)


class EventTap:
    """A SUB socket on one engine's event endpoint, read by a daemon thread it owns.

    ``close`` stops the thread (it polls with a short timeout) and then closes the socket in the
    thread that created it; frames read so far stay in ``frames``. The frame list is bounded by
    ``max_frames``: reaching the bound stops recording and sets ``overflowed`` so that a check
    built on a truncated stream fails loudly instead of passing on partial data.
    """

    def __init__(self, endpoint: str, max_frames: int = 200_000) -> None:
        self.endpoint = endpoint
        self.max_frames = max_frames
        self.frames: list[Frame] = []
        self.overflowed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx: Any = zmq.Context.instance()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tap {endpoint}", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # never drop: a lost frame would make the check lie
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                parts = sock.recv_multipart()
                if len(parts) != 3:
                    continue
                frame = Frame(parts[0], _seq(parts[1]), parts[2], time.monotonic())
                with self._lock:
                    if len(self.frames) >= self.max_frames:
                        self.overflowed = True
                        continue
                    self.frames.append(frame)
        finally:
            sock.close(0)

    def snapshot(self) -> list[Frame]:
        with self._lock:
            return list(self.frames)

    def last_frame_at(self) -> float:
        with self._lock:
            return self.frames[-1].received_at if self.frames else 0.0

    def wait_quiet(self, quiet_s: float = 0.5, deadline_s: float = 10.0) -> None:
        """Return once no frame arrived for ``quiet_s`` (the engine has published its last step)."""
        wait_quiet([self], quiet_s, deadline_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


def wait_quiet(taps: Iterable[EventTap], quiet_s: float = 0.5, deadline_s: float = 10.0) -> None:
    """Return once none of ``taps`` received a frame for ``quiet_s`` (or after ``deadline_s``)."""
    taps = list(taps)
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        last = max([t.last_frame_at() for t in taps] + [t0])
        if time.monotonic() - last >= quiet_s:
            return
        time.sleep(0.02)


def replay(endpoint: str, start_seq: int, timeout_s: float = 5.0, max_frames: int = 100_000) -> list[Frame]:
    """Ask the engine's replay endpoint for every buffered batch from ``start_seq``.

    DEALER socket: send ``["", start_seq]``; the engine answers ``["", topic, seq, payload]`` per
    batch and ends with a frame whose seq is -1 (included in the result so callers can see it).
    """
    ctx: Any = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out: list[Frame] = []
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)])
        while len(out) < max_frames:
            if not sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"replay from {endpoint}: no answer within {timeout_s} s")
            parts = sock.recv_multipart()
            # ["", topic, seq, payload]; the end marker may carry an empty payload.
            body = parts[1:] if parts and parts[0] == b"" else parts
            if len(body) < 2:
                continue
            topic = body[0] if len(body) >= 3 else b""
            seq = _seq(body[-2]) if len(body) >= 3 else _seq(body[0])
            payload = body[-1] if len(body) >= 3 else body[1]
            out.append(Frame(topic, seq, payload, 0.0))
            if seq == -1:
                break
    finally:
        sock.close(0)
    return out


# ---- decoding -------------------------------------------------------------------------------

ARRAY_FIELDS = {
    # The older tagged-array encoding: ["BlockStored", block_hashes, parent, token_ids, block_size,
    # lora_id, medium, ...]. Field order follows vLLM's msgspec struct declaration order.
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}


def _normalize_hash(h: Any) -> EngineHash:
    if isinstance(h, bytes):
        return h
    if isinstance(h, int):
        # Unsigned 64-bit by contract; a signed encoder (SGLang) yields negatives: fold them.
        return h & 0xFFFFFFFFFFFFFFFF
    raise ValueError(f"unexpected block hash type {type(h).__name__}")


def decode_event(raw: Any) -> dict[str, Any]:
    """One event as a dict with a ``type`` key, from either encoding."""
    if isinstance(raw, dict):
        ev = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
        if "type" not in ev:
            raise ValueError(f"event map without a type key: {sorted(ev)}")
        if isinstance(ev["type"], bytes):
            ev["type"] = ev["type"].decode()
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str | bytes):
        tag = raw[0].decode() if isinstance(raw[0], bytes) else raw[0]
        names = ARRAY_FIELDS.get(tag)
        if names is None:
            raise ValueError(f"unknown event tag {tag!r}")
        ev = {"type": tag}
        ev.update(dict(zip(names, raw[1:], strict=False)))
    else:
        raise ValueError(f"cannot decode event {raw!r:.80}")
    if "block_hashes" in ev:
        ev["block_hashes"] = [_normalize_hash(h) for h in ev["block_hashes"]]
    if ev.get("parent_block_hash") is not None:
        ev["parent_block_hash"] = _normalize_hash(ev["parent_block_hash"])
    return ev


def decode_payload(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """``[ts, events, dp_rank]`` (dp_rank absent in older releases)."""
    obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(obj, list | tuple) or len(obj) < 2:
        raise ValueError("event batch is not [ts, events, ...]")
    dp_rank = obj[2] if len(obj) > 2 else None
    return float(obj[0]), [decode_event(e) for e in obj[1]], dp_rank


# ---- independent reconstruction -------------------------------------------------------------


def _dense_stores_first(events: list[dict[str, Any]], block_size: int) -> list[dict[str, Any]]:
    """Within each run of consecutive BlockStored events, the ones listing a hash for every block
    first (stores commute); removals and clears keep their place."""
    out: list[dict[str, Any]] = []
    run: list[dict[str, Any]] = []
    for ev in [*events, None]:
        if ev is not None and ev["type"] == "BlockStored":
            run.append(ev)
            continue
        dense = [e for e in run if len(e["block_hashes"]) * block_size >= len(e["token_ids"])]
        out += dense + [e for e in run if all(e is not d for d in dense)]
        run = []
        if ev is not None:
            out.append(ev)
    return out


@dataclass
class HeldBlocks:
    """The blocks one engine holds, rebuilt from its event stream in seq order, and the keys it
    can reuse.

    ``engine`` maps (KV-cache group, engine block hash) to kvgate's key for every block a group
    currently holds (``None`` when the parent was never seen, so the key cannot be computed).
    Applying events is idempotent: a block stored twice stays one entry; removing an unknown block
    is a no-op. ``keys()`` is the set of keys whose prefix vLLM's prefix lookup would hit: for a
    plain model every held block; for a hybrid model (several groups, vLLM 0.32
    ``HybridKVCacheCoordinator.find_longest_cache_hit``) a key whose every group holds the blocks
    it needs there: full attention the block itself, a sliding window of W tokens the
    ``cdiv(W - 1, block_size)`` blocks ending at it (all of the prefix when it is shorter).
    """

    model: str
    block_size: int
    # hybrid: count physical copies (vLLM caches a block again when a hybrid lookup missed it;
    # each copy has its own BlockStored and BlockRemoved)
    hybrid: bool = False
    engine: dict[tuple[int | None, EngineHash], int | None] = field(default_factory=dict)
    copies: dict[tuple[int | None, EngineHash], int] = field(default_factory=dict)
    # Keys survive removal here: vLLM can remove a parent and later store a child of it.
    key_of: dict[EngineHash, int] = field(default_factory=dict)
    parent_of: dict[int, int | None] = field(default_factory=dict)  # key -> parent key (None: first)
    windows: dict[int | None, int] = field(default_factory=dict)  # group -> blocks needed at a hit
    last_seq: int = -1
    gaps: int = 0
    unkeyed: int = 0
    cleared: int = 0
    restarts: int = 0
    stored_events: int = 0
    removed_events: int = 0

    def apply_frames(self, frames: Iterable[Frame]) -> None:
        for f in frames:
            if f.seq < 0:
                continue
            if f.seq == 0 and self.last_seq >= 0:
                # seq restarts only with the engine, whose cache then starts empty: rebuild.
                self.restarts += 1
                self.engine.clear()
                self.copies.clear()
                self.key_of.clear()
                self.parent_of.clear()
                self.last_seq = -1
            elif f.seq <= self.last_seq:
                continue  # duplicate (replayed) batch
            if self.last_seq >= 0 and f.seq != self.last_seq + 1:
                self.gaps += 1
            self.last_seq = f.seq
            _, events, _ = decode_payload(f.payload)
            for ev in _dense_stores_first(events, self.block_size):
                self.apply(ev)

    def apply(self, ev: dict[str, Any]) -> None:
        kind = ev["type"]
        if kind == "BlockStored":
            self._stored(ev)
        elif kind == "BlockRemoved":
            self.removed_events += 1
            for h in ev["block_hashes"]:
                gh = (ev.get("group_idx"), h)
                if self.copies.get(gh, 1) > 1:
                    self.copies[gh] -= 1
                else:
                    self.copies.pop(gh, None)
                    self.engine.pop(gh, None)
        elif kind == "AllBlocksCleared":
            self.cleared += 1
            self.engine.clear()
            self.copies.clear()
        else:
            raise ValueError(f"unknown event type {kind!r}")

    def _stored(self, ev: dict[str, Any]) -> None:
        self.stored_events += 1
        bs = int(ev.get("block_size") or self.block_size)
        if bs != self.block_size:
            raise ValueError(f"engine block_size {bs} != expected {self.block_size}")
        group = ev.get("group_idx")
        window = ev.get("kv_cache_spec_sliding_window")
        if ev.get("kv_cache_spec_kind") == "sliding_window" and window:
            self.windows[group] = -(-(int(window) - 1) // bs)
        else:
            self.windows.setdefault(group, 1)
        hashes: list[EngineHash] = ev["block_hashes"]
        tokens: list[int] = ev["token_ids"]
        n = len(tokens) // bs
        if len(hashes) > n or len(tokens) != n * bs:
            raise ValueError(f"BlockStored: {len(hashes)} hashes but {len(tokens)} tokens")
        parent = ev.get("parent_block_hash")
        parent_key = root_key(self.model, ev.get("lora_name")) if parent is None else self.key_of.get(parent)
        keys: list[int | None]
        if parent_key is None:
            keys = [None] * n
            self.unkeyed += len(hashes)
        else:
            keys = list(chain_keys(parent_key, tokens, bs))
            up: int | None = None if parent is None else parent_key
            for k in keys:
                assert k is not None
                self.parent_of.setdefault(k, up)
                up = k
        # A sliding-window group lists only the blocks it cached. The hash of a position is the
        # same in every group: a block another group stored (applied first, see
        # _dense_stores_first) is at its position; otherwise assume the range's last blocks.
        positions = {k: i for i, k in enumerate(keys) if k is not None}
        offset = n - len(hashes)
        placed = [
            self.key_of[h] if self.key_of.get(h) in positions else keys[offset + i]
            for i, h in enumerate(hashes)
        ]
        for h, k in zip(hashes, placed, strict=True):
            if self.hybrid and (group, h) in self.engine:
                self.copies[(group, h)] = self.copies.get((group, h), 1) + 1
            self.engine[(group, h)] = k
            if k is not None:
                self.key_of[h] = k

    def keys(self) -> set[int]:
        held: dict[int | None, set[int]] = {g: set() for g in self.windows}
        for (g, _h), k in self.engine.items():
            if k is not None:
                held.setdefault(g, set()).add(k)
        if len(held) <= 1:
            return {k for ks in held.values() for k in ks}
        candidates = set().union(*held.values())
        return {
            k for k in candidates if all(self._window_held(k, held[g], self.windows.get(g, 1)) for g in held)
        }

    def _window_held(self, k: int, held: set[int], need: int) -> bool:
        x: int | None = k
        for _ in range(need):
            if x is None:
                return True  # the prefix is shorter than the window
            if x not in held:
                return False
            x = self.parent_of.get(x)
        return True

    def hit_blocks(self, request_keys: list[int], max_blocks: int) -> int:
        """vLLM's prefix hit, in blocks, for a request with these block keys: the deepest
        reusable key among the first ``max_blocks``."""
        reusable = self.keys()
        for j in range(min(max_blocks, len(request_keys)) - 1, -1, -1):
            if request_keys[j] in reusable:
                return j + 1
        return 0
