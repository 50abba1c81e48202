"""The replica model's paged KV cache: vLLM v1 ``BlockPool`` semantics (the contract is in
router_policies/sim/replica_model.py, "KV cache"): one free queue of unreferenced blocks, front
evicted first; a prefix hit pins a free cached block; a released request's blocks go back in
reverse order; a full prompt block becomes cached when the step computing its last token is
scheduled (``store_scheduled``)."""

from __future__ import annotations

from collections import OrderedDict

from router_policies.sim.engine_types import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, ReqState


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._hash: list[int | None] = [None] * num_blocks  # physical block -> cached id
        self._ref: list[int] = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(num_blocks)
        )  # front = evict first
        self._cached: dict[int, int] = {}  # id -> physical block

    def free_count(self) -> int:
        return len(self._free)

    def cached_ids(self) -> set[int]:
        return set(self._cached)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._cached

    def clear(self, events: list[KvEvent]) -> bool:
        """Forget every cached id (``AllBlocksCleared`` appended to ``events``); refused (False)
        while any block is pinned by a request."""
        if len(self._free) != self.num_blocks:
            return False
        for phys in self._cached.values():
            self._hash[phys] = None
        self._cached.clear()
        events.append(AllBlocksCleared())
        return True

    def allocate(self, k: int, events: list[KvEvent], out: list[int]) -> bool:
        """Pop ``k`` blocks from the front of the free queue into ``out`` (evicting their cached ids,
        reported as one BlockRemoved). False, with nothing changed, when fewer than ``k`` are free."""
        free = self._free
        if k > len(free):
            return False
        hashes = self._hash
        ref = self._ref
        cached = self._cached
        removed: list[int] = []
        for _ in range(k):
            phys, _none = free.popitem(last=False)
            old = hashes[phys]
            if old is not None:
                del cached[old]
                hashes[phys] = None
                removed.append(old)
            ref[phys] = 1
            out.append(phys)
        if removed:
            if events and isinstance(events[-1], BlockRemoved):
                events[-1] = BlockRemoved((*events[-1].block_ids, *removed))
            else:
                events.append(BlockRemoved(tuple(removed)))
        return True

    def release(self, r: ReqState) -> None:
        ref = self._ref
        free = self._free
        for phys in reversed(r.phys):
            ref[phys] -= 1
            if ref[phys] == 0:
                free[phys] = None
        r.phys = []
        r.kv_cap = 0

    def admit(self, r: ReqState, events: list[KvEvent]) -> int:
        """Give ``r`` its blocks (cached prefix pinned, the rest allocated) if the free queue can
        supply them: the number of prefix hits in blocks; -1 leaves everything unchanged."""
        bs = self.block_size
        cached = self._cached
        ref = self._ref
        ids = r.ids
        cap = min(r.n_ids, (r.target - 1) // bs)
        hits: list[int] = []
        for i in range(cap):
            phys = cached.get(ids[i])
            if phys is None:
                break
            hits.append(phys)
        n_hits = len(hits)
        need = -(-r.target // bs) - n_hits
        in_free = sum(1 for p in hits if ref[p] == 0)
        if need > len(self._free) - in_free:
            return -1
        free = self._free
        for p in hits:
            if ref[p] == 0:
                del free[p]
            ref[p] += 1
        self.allocate(need, events, hits)  # checked above: cannot fail
        r.phys = hits
        r.kv_cap = len(hits) * bs
        r.computed = n_hits * bs
        r.stored = n_hits
        if r.cached_tokens < 0:
            r.cached_tokens = r.computed
        return n_hits

    def store_scheduled(self, r: ReqState, tokens: int, events: list[KvEvent]) -> None:
        """Cache ``r``'s full prompt blocks within its first ``tokens`` tokens: those computed and
        those scheduled in this step (vLLM v1's ``allocate_slots`` caches the blocks of the tokens
        it schedules, so a request scheduled after them in the same step hits them)."""
        full = min(tokens // self.block_size, r.n_ids)
        if full <= r.stored:
            return
        ids = r.ids
        cached = self._cached
        run: list[int] = []
        parent: int | None = ids[r.stored - 1] if r.stored > 0 else None
        for i in range(r.stored, full):
            bid = ids[i]
            if bid in cached:
                if run:
                    events.append(BlockStored(tuple(run), parent))
                    run = []
                parent = bid
                continue
            phys = r.phys[i]
            cached[bid] = phys
            self._hash[phys] = bid
            run.append(bid)
        if run:
            events.append(BlockStored(tuple(run), parent))
        r.stored = full
