"""One replica's approximate entries in LRU order (docs/architecture.md, "The index"): pure
functions over the ``OrderedDict`` key -> touch stamp that ``PrefixIndex`` keeps per replica.

Invariants they keep (``PrefixIndex``'s docstring states why): oldest first, every block before
its parent, stamps non-decreasing along the order.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque

import numpy as np
import numpy.typing as npt

Approx = OrderedDict[int, float]


def lower_later_stamps(approx: Approx, stamp: float) -> None:
    """Keep stamps monotone along the order before entries stamped ``stamp`` are appended: the
    newest entries stamped later are lowered to ``stamp`` (a suffix, as stamps are monotone;
    values change in place, the order does not)."""
    later = list(itertools.takewhile(lambda kv: kv[1] > stamp, reversed(approx.items())))
    for k, _ in later:
        approx[k] = stamp


def touch(
    approx: Approx,
    rev_arr: npt.NDArray[np.uint64],
    held: npt.NDArray[np.uint8],
    stamp: float,
    no_precise: bool = False,
) -> list[int]:
    """Move the touched keys ``rev_arr`` (a prompt's keys, leaf first) to the end, stamped
    ``stamp``, except those the replica holds precisely (``held`` set and not in ``approx``).
    ``no_precise``: the replica holds nothing precisely (every set bit is an entry of ``approx``).
    Returns the keys that are new entries (their bits must be set by the caller)."""
    rev = rev_arr.tolist()
    if held.all():
        if not no_precise and approx.keys().isdisjoint(rev):
            return []  # every key held precisely (a warm prompt): nothing to touch, in C-level checks
        if no_precise or all(map(approx.__contains__, rev)):
            # every key an approximate entry (the refresh of a routed prompt, the usual full
            # touch): the per-key walk below without its branches, the moves in one C-level pass.
            # Moving (not deleting and re-inserting) also leaves the dict no dummy slots to
            # resize away later (~3x faster, measured: docs/performance.md, "Fourth pass").
            deque(map(approx.move_to_end, rev), 0)
            for k in rev:
                approx[k] = stamp
            return []
    fresh: list[int]
    if len(set(rev)) != len(rev):
        # repeated keys (never in a real chained prompt): the plain per-key walk
        fresh = []
        for k, h in zip(rev, held.tolist(), strict=True):
            if k in approx:
                approx.move_to_end(k)
                approx[k] = stamp
            elif not h:
                approx[k] = stamp
                fresh.append(k)
        return fresh
    # Every touched key that is not held precisely ends up at the end of the LRU order, leaf
    # first (reversed prompt order), stamped ``stamp``; untouched entries keep their order before
    # them. So: take the touched ones out, then append them all in one C-level update. A key with
    # the replica's bit is approximate iff it is in ``approx``.
    if held.any():
        with_bit = set(rev_arr[held != 0].tolist())
        precise = {k for k in with_bit if k not in approx}
        if precise:
            rev = [k for k in rev if k not in precise]
        for k in with_bit - precise:
            del approx[k]
        fresh = rev_arr[held == 0].tolist()
    else:
        fresh = rev
    approx.update(dict.fromkeys(rev, stamp))
    return fresh


def pop_expired(approx: Approx, deadline: float) -> list[int]:
    """Pop the entries stamped before ``deadline`` (a prefix of the order: stamps are monotone)."""
    gone = [k for k, _ in itertools.takewhile(lambda kv: kv[1] < deadline, approx.items())]
    for _ in gone:
        approx.popitem(last=False)
    return gone


def first_of(approx: Approx, keys: list[int]) -> int:
    """The position of the first of ``keys`` that is an approximate entry (``len(keys)``: none)."""
    if approx.keys().isdisjoint(keys):  # the usual answer (a prompt held precisely), in C
        return len(keys)
    return next((i for i, k in enumerate(keys) if k in approx), len(keys))
