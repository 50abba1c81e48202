"""Per-KV-cache-group inventory for hybrid-attention models (docs/architecture.md, agent).

vLLM runs a hybrid model (sliding-window + full attention: Gemma 3, gpt-oss; Mamba hybrids) with
one KV-cache group per attention type. Each group publishes its own BlockStored/BlockRemoved
(``group_idx``), with the *same* block hash for the same token position, and a group keeps only
the blocks its layers need: a sliding-window group stores just the blocks inside the window when
it caches them (``block_hashes`` then lists only those, while ``token_ids`` spans the whole
range) and frees blocks that fall out of the window early.

What the engine can reuse is what vLLM's hybrid prefix lookup returns
(``HybridKVCacheCoordinator.find_longest_cache_hit``; vllm 0.32): a prefix of ``j + 1`` blocks
is a hit exactly when *every* group accepts it, where a full-attention group needs its leading
run of blocks to reach ``j`` and a sliding-window group of window ``W`` tokens needs the
``cdiv(W - 1, block_size)`` blocks ending at ``j`` (``SlidingWindowManager``; fewer when the
prefix is shorter). The lookup returns the deepest such ``j`` below the request's bound. So a
block key is *reusable* when the prefix ending at it is a hit, and that set is what this tracker
reports: the request's hit is its deepest reusable key. (It is not closed under prefixes: a
reusable key's ancestors need not be reusable.)

Approximation: for a full-attention group only block ``j`` itself is checked, not its ancestors.
vLLM frees a request's blocks tail first and evicts in free order, and a request re-using a block
re-uses all its ancestors, so a full-attention group that holds a block holds its ancestors (no
exception in 73 recorded and 62 live requests, tests/data/vllm_events/hybrid_*). Other group
kinds (Mamba) are checked like full attention, at block ``j``; only sliding-window and
full-attention groups were observed.

Invariants
* ``_res`` maps (group, engine hash or (hash, medium)) to a key for every block a group holds,
  oldest first, at most ``max_blocks`` entries (beyond: the oldest is dropped as evicted);
  ``_copies`` counts the physical copies of those stored more than once (each copy is stored
  and removed by its own event), its keys a subset of ``_res``'s;
  ``_held[g][k]`` counts the entries of group ``g`` mapping to ``k``.
* ``_up``/``_down`` link keys to parents/children for every position of every stored range
  (held or not: a window check walks through blocks a group never cached), at most
  ``2 * max_blocks`` links and hashes, oldest dropped first; an unknown parent ends the walk.
* ``reported[k]`` exists exactly when ``k`` is reusable (``_reusable(k)``) over the groups seen,
  and every change of it is passed to the sink in order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from replica_agent.engine_events import BlockStored, EngineHash
from router_policies.block_keys import chain_keys

FULL = "full_attention"
MAX_GROUPS = 64  # KV-cache groups tracked (a real model has a handful)
SLIDING = "sliding_window"
ResKey = tuple[int, EngineHash | tuple[EngineHash, str]]


class Sink:
    """The subset of ``InventorySink`` this module calls (kept structural to avoid an import cycle)."""

    def stored(self, keys: list[int], parent: int | None, medium: str) -> None: ...

    def removed(self, keys: list[int], medium: str) -> None: ...


def order_stores(events: list[Any]) -> list[Any]:
    """Within each run of consecutive BlockStored events of one engine step, those listing every
    block of their range first (stores commute; removals keep their place): a sliding-window
    group's sparse store can then find its blocks' positions by hash."""
    out: list[Any] = []
    run: list[BlockStored] = []
    for ev in [*events, None]:
        if type(ev) is BlockStored:
            run.append(ev)
            continue
        if run:
            bs = [len(e.token_ids) // max(e.block_size, 1) for e in run]
            out += [e for e, n in zip(run, bs, strict=True) if len(e.block_hashes) >= n]
            out += [e for e, n in zip(run, bs, strict=True) if len(e.block_hashes) < n]
            run = []
        if ev is not None:
            out.append(ev)
    return out


def window_blocks(kind: str | None, window: int | None, block_size: int) -> int:
    """Blocks ending at ``j`` a group must hold for a prefix through ``j`` to hit."""
    if kind == SLIDING and window:
        return max(1, -(-(window - 1) // block_size))
    return 1  # full attention, Mamba: block j itself (see the module docstring)


class GroupTracker:
    def __init__(self, block_size: int, max_blocks: int, sink: Sink | None) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.sink = sink
        self.need: dict[int, int] = {}  # group -> blocks its window needs
        self.kinds: dict[int, str | None] = {}
        self._res: OrderedDict[ResKey, int] = OrderedDict()
        self._copies: dict[ResKey, int] = {}  # entries of _res stored more than once: how often
        self._held: dict[int, dict[int, int]] = {}
        self._up: OrderedDict[int, int | None] = OrderedDict()
        # engine hash -> key of every block stored by any group, kept after removal (a parent can
        # be a block no group holds any more, or one a sliding-window group never cached)
        self.key_of: OrderedDict[EngineHash | tuple[EngineHash, str], int] = OrderedDict()
        self._down: dict[int, set[int]] = {}
        self.reported: dict[int, str] = {}
        self.overflow_evictions = 0

    # ---- events ---------------------------------------------------------------------------
    def store(self, ev: BlockStored, parent_key: int, default_group: int) -> int | None:
        """Apply a BlockStored whose parent is keyed ``parent_key``; returns the blocks stored,
        None when its token ids cannot be keyed."""
        bs = self.block_size
        tokens = ev.token_ids
        n = len(tokens) // bs
        if n == 0:
            return 0
        try:
            keys = chain_keys(parent_key, tokens[: n * bs] if len(tokens) != n * bs else tokens, bs)
        except (ValueError, TypeError, OverflowError):
            return None
        group = ev.group if ev.group is not None else default_group
        if group not in self.need and len(self.need) >= MAX_GROUPS:
            return 0  # not an engine's group layout: bounded, ignored
        self.learn(group, ev.spec_kind, ev.window)
        self.link(None if ev.parent is None else parent_key, list(keys))
        # vLLM lists only the blocks the group cached (a sliding-window group skips those out of
        # its window, but keeps the window ending at a shared-prefix junction), while token_ids
        # spans the whole range. A listed hash is the same for every group at one position, so its
        # position is where another group's store put it (``order_stores`` applies the stores that
        # list every block first); failing that, the range's last blocks. (SGLang may list one
        # more hash than full blocks, for a partial last page: it is not keyed.)
        hashes = ev.block_hashes[:n]
        medium = ev.medium
        gpu = medium == "GPU"
        if len(hashes) < n:
            at = {k: i for i, k in enumerate(keys)}
            key_of = self.key_of
            offset = n - len(hashes)
            picked = []
            for i, h in enumerate(hashes):
                mk = h if gpu else (h, medium)
                known = key_of.get(mk)
                picked.append((mk, known if known in at else keys[offset + i]))
        else:
            picked = [(h if gpu else (h, medium), k) for h, k in zip(hashes, keys, strict=False)]
        self.hold(group, picked, medium)
        return len(hashes)

    def adopt(
        self,
        group: int,
        mapping: dict[EngineHash | tuple[EngineHash, str], int],
        links: dict[int, int],
        roots: set[int],
        reported: dict[int, str],
    ) -> None:
        """Take over a full-attention group tracked without groups so far, without reporting
        again what was reported already."""
        self.learn(group, FULL, None)
        for k, parent in links.items():
            self.link(None if parent in roots else parent, [k])
        self.reported.update(reported)
        self.hold(group, mapping.items(), "GPU")

    # ---- groups and links ----------------------------------------------------------------
    def learn(self, group: int, kind: str | None, window: int | None) -> None:
        """A group's first event: every reported key must now satisfy it too."""
        if group in self.need:
            return
        self.need[group] = window_blocks(kind, window, self.block_size)
        self.kinds[group] = kind
        self._held.setdefault(group, {})
        self._refresh(list(self.reported), "GPU")

    def link(self, parent: int | None, keys: list[int]) -> None:
        up = self._up
        down = self._down
        for k in keys:
            if k in up:
                up.move_to_end(k)
            else:
                up[k] = parent
                if parent is not None:
                    down.setdefault(parent, set()).add(k)
            parent = k
        bound = 2 * self.max_blocks
        unlinked: list[int] = []
        while len(up) > bound:
            k, p = up.popitem(last=False)
            unlinked.append(k)
            if p is not None and (kids := down.get(p)) is not None:
                kids.discard(k)
                if not kids:
                    del down[p]
        if unlinked:
            # a window that walked through a dropped link can no longer be checked: the keys
            # reported on it are re-evaluated (``_reusable`` then says no), not left reported
            self._refresh_below_any(unlinked)

    # ---- residency -----------------------------------------------------------------------
    def hold(
        self, group: int, entries: Iterable[tuple[EngineHash | tuple[EngineHash, str], int]], medium: str
    ) -> int:
        """Group ``group`` now holds these (engine hash, key) blocks; returns how many were new."""
        res = self._res
        copies = self._copies
        held = self._held[group]
        changed: list[int] = []
        new = 0
        for mk, k in entries:
            rk = (group, mk)
            self.key_of[mk] = k
            old = res.get(rk)
            if old == k:
                # one more physical copy of the block: vLLM does not de-duplicate its cache
                # (BlockHashToBlockMap), and a hybrid engine recomputes blocks its full-attention
                # group holds whenever the window group misses; each copy is removed on its own
                copies[rk] = copies.get(rk, 1) + 1
                res.move_to_end(rk)
                continue
            if old is not None:
                self._unhold(group, old, changed)
            res[rk] = k
            held[k] = held.get(k, 0) + 1
            changed.append(k)
            new += 1
        key_of = self.key_of
        while len(key_of) > 2 * self.max_blocks:  # after this event's hashes are in
            key_of.popitem(last=False)
        self._refresh_below(group, changed, medium)
        if len(res) > self.max_blocks:
            self._overflow()
        return new

    def release(
        self, group: int, mks: Iterable[EngineHash | tuple[EngineHash, str]], medium: str
    ) -> tuple[int, int]:
        """Group ``group`` dropped these blocks; returns (translated, unknown)."""
        res = self._res
        copies = self._copies
        changed: list[int] = []
        unknown = 0
        known = 0
        for mk in mks:
            rk = (group, mk)
            n = copies.get(rk)
            if n is not None:
                known += 1
                if n > 2:
                    copies[rk] = n - 1
                else:
                    del copies[rk]
                continue
            k = res.pop(rk, None)
            if k is None:
                unknown += 1
                continue
            known += 1
            self._unhold(group, k, changed)
        self._refresh_below(group, changed, medium)
        return known, unknown

    def _unhold(self, group: int, k: int, changed: list[int]) -> None:
        held = self._held[group]
        r = held[k] - 1
        if r:
            held[k] = r
        else:
            del held[k]
            changed.append(k)

    def _overflow(self) -> None:
        res = self._res
        while len(res) > self.max_blocks:
            rk, k = res.popitem(last=False)
            group = rk[0]
            self._copies.pop(rk, None)
            self.overflow_evictions += 1
            changed: list[int] = []
            self._unhold(group, k, changed)
            self._refresh_below(group, changed, "GPU")

    def clear(self) -> None:
        self._res.clear()
        self._copies.clear()
        for held in self._held.values():
            held.clear()
        self._up.clear()
        self._down.clear()
        self.key_of.clear()
        self.reported.clear()

    # ---- the reusable set ----------------------------------------------------------------
    def _reusable(self, k: int) -> bool:
        up = self._up
        for group, need in self.need.items():
            held = self._held[group]
            x: int | None = k
            for i in range(need):
                if x is None:
                    break  # the prefix is shorter than the window: all of it is held
                if x not in held:
                    return False
                if i + 1 < need:
                    if x not in up:
                        return False  # a link was dropped: the window cannot be checked
                    x = up[x]
        return True

    def _refresh_below(self, group: int, keys: list[int], medium: str) -> None:
        """Re-evaluate ``keys`` and the descendants whose window reaches them."""
        if keys:
            self._refresh(self._with_descendants(keys, self.need.get(group, 1) - 1), medium)

    def _refresh_below_any(self, keys: list[int]) -> None:
        """Re-evaluate ``keys`` and their descendants as deep as any group's window reaches
        (nothing to do when every group needs only its own block: no window walks a link)."""
        depth = max(self.need.values(), default=1) - 1
        if depth and self.reported:
            todo = self._with_descendants(keys, depth)
            self._refresh([k for k in todo if k in self.reported], "GPU")

    def _with_descendants(self, keys: list[int], depth: int) -> list[int]:
        """``keys`` and their descendants down to ``depth`` generations (by the links kept)."""
        todo = list(keys)
        frontier = keys
        down = self._down
        for _ in range(depth):
            frontier = [c for k in frontier for c in down.get(k, ())]
            if not frontier:
                break
            todo += frontier
        return todo

    def _refresh(self, keys: list[int], medium: str) -> None:
        reported = self.reported
        added: list[int] = []
        gone: dict[str, list[int]] = {}
        seen: set[int] = set()
        for k in keys:
            if k in seen:
                continue
            seen.add(k)
            ok = self._reusable(k)
            if ok and k not in reported:
                reported[k] = medium
                added.append(k)
            elif not ok and k in reported:
                gone.setdefault(reported.pop(k), []).append(k)
        sink = self.sink
        if sink is not None:
            for m, ks in gone.items():
                sink.removed(ks, m)
            if added:
                sink.stored(added, None, medium)
