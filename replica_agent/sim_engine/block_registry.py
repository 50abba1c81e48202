"""What the engine knows about each block id it gave the replica model.

The replica model sees blocks as opaque chained ids; we use kvgate keys for them (so
``/debug/blocks`` is the model's own cached set). To publish vLLM-shaped events we also need, per
id, the engine's own hash, its parent's hash and its tokens. This registry keeps that, and only
while it can still be needed:

- an id is *referenced* while a request that contains it is in the engine (submit .. finish/abort);
- an id is *cached* from its BlockStored to its BlockRemoved (or AllBlocksCleared).

Invariant: an entry exists iff it is referenced or cached, so the registry never holds more than
``num_blocks`` cached entries plus the blocks of in-flight requests (itself bounded by the engine's
pending-request bound times ``max_model_len / block_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

from replica_agent.sim_engine import kv_events as wire
from replica_agent.sim_engine.engine_hashes import HashFormat, block_digest, external_hash, root_digest
from router_policies.block_keys import chain_keys, root_key
from router_policies.sim import replica_model as rm


@dataclass(slots=True)
class BlockInfo:
    ext: int | bytes  # the engine hash published for this block
    parent_ext: int | bytes | None
    tokens: tuple[int, ...]
    refs: int = 0
    cached: bool = False


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    keys: list[int]  # kvgate keys of the full blocks, the replica model's block ids
    infos: list[BlockInfo]


class BlockRegistry:
    def __init__(self, model_name: str, block_size: int, fmt: HashFormat) -> None:
        self.block_size = block_size
        self._fmt = fmt
        self._root_key = root_key(model_name)
        self._root_digest = root_digest(model_name)
        self._blocks: dict[int, BlockInfo] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def describe(self, tokens: list[int]) -> PromptBlocks:
        """Keys and engine hashes of the prompt's full blocks (pure: registers nothing)."""
        bs = self.block_size
        keys = chain_keys(self._root_key, tokens, bs)
        infos: list[BlockInfo] = []
        parent_digest = self._root_digest
        parent_ext: int | bytes | None = None
        for i in range(len(keys)):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            digest = block_digest(parent_digest, block_tokens)
            ext = external_hash(digest, self._fmt)
            infos.append(BlockInfo(ext, parent_ext, block_tokens))
            parent_digest, parent_ext = digest, ext
        return PromptBlocks(keys, infos)

    def acquire(self, blocks: PromptBlocks) -> None:
        for key, info in zip(blocks.keys, blocks.infos, strict=True):
            entry = self._blocks.setdefault(key, info)
            entry.refs += 1

    def release(self, keys: list[int]) -> None:
        for key in keys:
            entry = self._blocks[key]
            entry.refs -= 1
            if entry.refs == 0 and not entry.cached:
                del self._blocks[key]

    def translate(self, events: list[rm.KvEvent]) -> list[wire.KvEvent]:
        """The replica model's events of one step as vLLM events, updating the cached flags.
        BlockRemoved goes out one hash per event, as vLLM sends it."""
        out: list[wire.KvEvent] = []
        blocks = self._blocks
        for ev in events:
            if isinstance(ev, rm.BlockStored):
                hashes: list[int | bytes] = []
                tokens: list[int] = []
                for key in ev.block_ids:
                    info = blocks[key]
                    info.cached = True
                    hashes.append(info.ext)
                    tokens.extend(info.tokens)
                parent = None if ev.parent is None else blocks[ev.parent].ext
                out.append(wire.BlockStored(hashes, parent, tokens, self.block_size))
            elif isinstance(ev, rm.BlockRemoved):
                for key in ev.block_ids:
                    info = blocks[key]
                    info.cached = False
                    if info.refs == 0:
                        del blocks[key]
                    out.append(wire.BlockRemoved([info.ext]))
            else:
                for key in [k for k, info in blocks.items() if info.cached]:
                    info = blocks[key]
                    info.cached = False
                    if info.refs == 0:
                        del blocks[key]
                out.append(wire.AllBlocksCleared())
        return out
