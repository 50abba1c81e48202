"""kv_aware's speed groups (kv_aware's docstring: speed_r, group_r, "Why time_r"): the replicas
priced alike because their fitted speeds are within a factor of each other."""

from __future__ import annotations

SPEED_MIN_TOKENS, SPEED_MAX_TOKENS = 256, 32768  # speed_r's prompt sizes


def speed_size(prompt_tokens: int) -> int:
    """The prompt size speed_r is read at: ``prompt_tokens`` rounded up to a power of two, within
    [SPEED_MIN_TOKENS, SPEED_MAX_TOKENS] (a few sizes, so the readings are remembered)."""
    return min(max(SPEED_MIN_TOKENS, 1 << max(prompt_tokens - 1, 0).bit_length()), SPEED_MAX_TOKENS)


def speed_groups(refs: list[float], ratio: float) -> list[float]:
    """Per replica, the median (the upper one) reference TTFT of its speed group: the replicas
    sorted by ``refs``, a new group wherever one's ref is more than ``ratio`` times the group's
    first (its fastest: no chain of small steps joins replicas ``ratio`` apart; docstring: group_r)."""
    order = sorted(range(len(refs)), key=refs.__getitem__)
    out = list(refs)
    start = 0
    for k in range(1, len(order) + 1):
        if k == len(order) or refs[order[k]] > ratio * refs[order[start]]:
            group = order[start:k]
            median = refs[group[len(group) // 2]]
            for i in group:
                out[i] = median
            start = k
    return out
