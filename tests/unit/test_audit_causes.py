"""Every inexact cached-token prediction gets a cause (gateway.prediction_audit.inexact_cause),
from what the index said at dispatch (placement.IndexAtDispatch) and says at the audit."""

from __future__ import annotations

import pytest

from gateway.prediction_audit import AuditCase, inexact_cause
from router_policies.placement import IndexAtDispatch
from router_policies.prefix_index import PrefixIndex

BS = 16
KEYS = [101, 102, 103, 104, 105, 106]


def _index() -> PrefixIndex:
    index = PrefixIndex()
    index.add_replica("r")
    return index


def _cause(index: PrefixIndex, predicted_blocks: int, reported_blocks: int, at: IndexAtDispatch) -> str:
    case = AuditCase(KEYS, BS, predicted_blocks * BS, reported_blocks * BS, at)
    return inexact_cause(index, "r", case)


def test_the_index_at_dispatch_counts_the_leading_precise_blocks() -> None:
    index = _index()
    index.store("r", KEYS[:3])
    index.touch_approximate("r", KEYS[:5], 0.0, 10.0)  # a request routed there before
    at = IndexAtDispatch.of(index, "r", KEYS, 5)
    assert at == IndexAtDispatch(3, 0)
    index.remove("r", KEYS[2:3])
    assert index.removed_count("r") == 1 and index.precise_run("r", KEYS) == 2


@pytest.mark.parametrize(
    ("precise", "removed_after", "cause"),
    [
        (3, [], "concurrent_not_stored"),  # blocks 3, 4 were only a request's speculative entries
        (5, [3, 4], "evicted"),  # the engine reported removals since the decision
        (5, [], "stale_index"),  # held precisely, no removal since: the index was wrong
    ],
)
def test_over_prediction_causes(precise: int, removed_after: list[int], cause: str) -> None:
    """Five blocks predicted, three reported."""
    index = _index()
    index.store("r", KEYS[:precise])
    index.touch_approximate("r", KEYS[:5], 0.0, 10.0)
    at = IndexAtDispatch.of(index, "r", KEYS, 5)
    assert at.precise_blocks == precise
    index.remove("r", [KEYS[i] for i in removed_after])
    assert _cause(index, 5, 3, at) == cause


def test_under_prediction_is_late_events_or_tokenization() -> None:
    index = _index()
    index.store("r", KEYS[:2])
    at = IndexAtDispatch.of(index, "r", KEYS, 2)
    assert _cause(index, 2, 4, at) == "tokenization"  # the engine's blocks never carried our keys
    index.store("r", KEYS[:4])  # the events of a concurrent request arrived since
    assert _cause(index, 2, 4, at) == "not_yet_reported"
