"""A process tree's CPU time read from /proc (utime + stime of the process, its threads, and its
live descendants): how the benchmarks charge CPU seconds to a gateway. The processes themselves are
started and stopped by ``kvgate_tools.procs.ProcessGroup``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid``, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    rest = raw[raw.rindex(")") + 2 :].split()
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK


def threads_cpu_s(pid: int, name: str) -> float:
    """CPU seconds used so far by the threads of ``pid`` whose OS name is ``name``."""
    total = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() != name:
                continue
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        rest = raw[raw.rindex(")") + 2 :].split()
        total += (int(rest[11]) + int(rest[12])) / _TICK
    return total


def _trees(roots: Sequence[int]) -> dict[int, dict[int, float]]:
    """Per root, CPU seconds so far of it and each of its live descendants, by pid (one read of
    /proc for them all)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                parents[int(entry)], cpu[int(entry)] = st
    wanted = set(roots)
    out: dict[int, dict[int, float]] = {root: {} for root in roots}
    for pid, c in cpu.items():
        p = pid
        while p and p not in wanted:
            p = parents.get(p, 0)
        if p:
            out[p][pid] = c
    return out


def _tree(root: int) -> dict[int, float]:
    """CPU seconds so far of ``root`` and each of its live descendants, by pid."""
    return _trees([root])[root]


def trees_cpu_s(roots: Sequence[int]) -> list[float]:
    """``tree_cpu_s`` of each of ``roots`` (disjoint trees: a pid counts for its nearest root)."""
    trees = _trees(roots)
    return [sum(trees[root].values()) for root in roots]


def tree_pids(root: int) -> list[int]:
    """``root`` and its live descendants (children, grandchildren, ...)."""
    return list(_tree(root))


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by ``root`` and its live descendants."""
    return sum(_tree(root).values())


def tree_threads_cpu_s(root: int, name: str) -> float:
    """``threads_cpu_s`` over ``root`` and its live descendants (a gateway's workers)."""
    return sum(threads_cpu_s(pid, name) for pid in _tree(root))
