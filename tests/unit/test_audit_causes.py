"""Every inexact cached-token prediction gets a cause (gateway.prediction_audit.inexact_cause),
from what the index said at dispatch (placement.IndexAtDispatch) and says at the audit."""

from __future__ import annotations

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


def test_over_prediction_on_speculative_entries_is_a_concurrent_request_not_stored() -> None:
    index = _index()
    index.store("r", KEYS[:3])
    index.touch_approximate("r", KEYS[:5], 0.0, 10.0)
    at = IndexAtDispatch.of(index, "r", KEYS, 5)
    assert _cause(index, 5, 3, at) == "concurrent_not_stored"


def test_over_prediction_with_removals_since_dispatch_is_an_eviction() -> None:
    index = _index()
    index.store("r", KEYS[:5])
    at = IndexAtDispatch.of(index, "r", KEYS, 5)
    index.remove("r", KEYS[3:5])  # the engine evicted them after the decision
    assert _cause(index, 5, 3, at) == "evicted"


def test_over_prediction_without_any_removal_is_a_stale_index() -> None:
    index = _index()
    index.store("r", KEYS[:5])
    at = IndexAtDispatch.of(index, "r", KEYS, 5)
    assert _cause(index, 5, 3, at) == "stale_index"


def test_under_prediction_is_late_events_or_tokenization() -> None:
    index = _index()
    index.store("r", KEYS[:2])
    at = IndexAtDispatch.of(index, "r", KEYS, 2)
    assert _cause(index, 2, 4, at) == "tokenization"  # the engine's blocks never carried our keys
    index.store("r", KEYS[:4])  # the events of a concurrent request arrived since
    assert _cause(index, 2, 4, at) == "not_yet_reported"
