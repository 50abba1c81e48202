"""Every inexact cached-token prediction gets a cause (gateway.prediction_audit.inexact_cause),
from what the index said at dispatch (placement.IndexAtDispatch) and says at the audit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.config import parse_config
from gateway.features.budgets import DeferredLimits
from gateway.features.deferred import DeferredEncodes
from gateway.features.deferred_job import DeferredJob
from gateway.features.feature_info import FeatureInfo
from gateway.features.segment_encoder import BoundedLRU, SegmentEncoder
from gateway.features.tokenizer_files import load_tokenizer_files
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.prediction_audit import AttemptAudit, AuditCase, inexact_cause
from gateway.replica_audit import AuditStats
from gateway.upstream import LATE_AUDIT_S, Upstream
from gateway.upstream_client import UpstreamClient
from router_policies.placement import IndexAtDispatch
from router_policies.prefix_index import PrefixIndex

BS = 16
TINY = Path(__file__).resolve().parents[2] / "assets/tokenizers/kvgate-tiny"
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
    at = IndexAtDispatch.of(index, "r", KEYS, (5, 0))
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
    at = IndexAtDispatch.of(index, "r", KEYS, (5, 0))
    assert at.precise_blocks == precise
    index.remove("r", [KEYS[i] for i in removed_after])
    assert _cause(index, 5, 3, at) == cause


def test_under_prediction_is_late_events_or_tokenization() -> None:
    index = _index()
    index.store("r", KEYS[:2])
    at = IndexAtDispatch.of(index, "r", KEYS, (2, 0))
    assert _cause(index, 2, 4, at) == "tokenization"  # the engine's blocks never carried our keys
    index.store("r", KEYS[:4])  # the events of a concurrent request arrived since
    assert _cause(index, 2, 4, at) == "not_yet_reported"


def test_over_prediction_with_another_prompt_length_is_tokenization() -> None:
    index = _index()
    index.store("r", KEYS[:5])
    at = IndexAtDispatch.of(index, "r", KEYS, (5, 0))
    for engine_tokens, cause in ((100, "stale_index"), (104, "tokenization"), (None, "stale_index")):
        case = AuditCase(KEYS, BS, 5 * BS, 3 * BS, at, gateway_tokens=100, engine_tokens=engine_tokens)
        assert inexact_cause(index, "r", case) == cause


def test_more_cached_blocks_than_the_prompt_has_is_tokenization() -> None:
    index = _index()
    index.store("r", KEYS)
    at = IndexAtDispatch.of(index, "r", KEYS, (6, 0))
    assert _cause(index, 6, 7, at) == "tokenization"  # the index holds every key: not a late event


def test_blocks_gone_from_the_index_again_are_told_by_the_prompt_length() -> None:
    """Four blocks reported, none predicted, none held by the index now (stored after the
    decision and evicted since, or never under the request's keys)."""
    index = _index()
    at = IndexAtDispatch.of(index, "r", KEYS, (0, 0))

    def cause(engine_tokens: int | None, degraded: bool = False) -> str:
        case = AuditCase(KEYS, BS, 0, 4 * BS, at, gateway_tokens=100, engine_tokens=engine_tokens,
                         agent_degraded=degraded)  # fmt: skip
        return inexact_cause(index, "r", case)

    assert cause(100) == "not_yet_reported"  # same tokens: the engine's blocks carry our keys
    assert cause(100, degraded=True) == "stale_index"  # ... and the agent says it lost some
    assert cause(104) == "tokenization"
    assert cause(None) == "tokenization"  # nothing says the engine's blocks were ours


def test_deferred_features_are_audited_on_the_keys_they_had() -> None:
    """Routed on the first two keys (the rest encoded after routing): four blocks reported."""
    index = _index()
    index.store("r", KEYS[:2])
    at = IndexAtDispatch.of(index, "r", KEYS[:2], (2, 0))

    def cause(predicted: int, full: list[int] | None, engine_tokens: int | None = None) -> str:
        case = AuditCase(
            KEYS[:2], BS, predicted * BS, 4 * BS, at, "deferred", full, engine_tokens=engine_tokens
        )
        return inexact_cause(index, "r", case)

    # block 2, the first not credited, had no key at the decision
    assert cause(2, None) == "deferred_encode"  # its encode not done by the audit
    assert cause(2, KEYS, 6 * BS + 3) == "deferred_encode"  # the engine's length fits the keys
    # the index lacks blocks 2, 3 under the prompt's keys and the engine's prompt is not ours
    assert cause(2, KEYS, 9 * BS) == "tokenization"
    index.store("r", KEYS[:4])
    assert cause(2, KEYS, 9 * BS) == "deferred_encode"  # held: the blocks were ours
    # block 1 had a key: late events, as for exact features
    assert cause(1, KEYS) == "not_yet_reported"
    # an over-prediction is within the keys routed on: the exact features' causes
    over = AuditCase(KEYS[:2], BS, 2 * BS, BS, IndexAtDispatch(2, 0), "deferred")
    assert inexact_cause(index, "r", over) == "stale_index"


def test_character_block_features_are_approximate() -> None:
    index = _index()
    index.store("r", KEYS)
    at = IndexAtDispatch.of(index, "r", KEYS, (6, 0))
    for predicted, reported in ((6 * BS, 3), (0, 40)):
        case = AuditCase(KEYS, BS, predicted, reported, at, "approximate")
        assert inexact_cause(index, "r", case) == "approximate_features"


def test_a_cause_is_given_iff_the_prediction_is_inexact() -> None:
    stats = AuditStats()
    assert stats.record(32, 32) == "exact" and stats.record(32, 16, "evicted") == "over"
    assert stats.record(0, 16, "tokenization") == "under"
    assert (stats.total, stats.exact, stats.causes) == (3, 1, {"evicted": 1, "tokenization": 1})
    with pytest.raises(ValueError, match="iff"):
        stats.record(32, 16)
    with pytest.raises(ValueError, match="iff"):
        stats.record(32, 32, "evicted")
    assert stats.total == 3


async def test_an_attempt_audit_waits_for_the_deferred_encodes_keys() -> None:
    """An attempt routed before its new text was encoded takes that encode's whole keys (the
    proxy's ``on_keys`` still runs); the audit of an inexact prediction can wait for them."""
    tok = load_tokenizer_files(TINY, where="t").tokenizer
    enc = SegmentEncoder(tok, BoundedLRU(100), "t")
    deferred = DeferredEncodes(DeferredLimits(100_000), lambda: None)  # encoded on the event loop

    def attempt(fingerprint: int) -> tuple[DeferredJob, AttemptAudit, list[list[int]]]:
        prompt = " ".join(f"word{i}" for i in range(200 + fingerprint))
        job = DeferredJob(
            enc, enc.plan(prompt, add_special_tokens=False), False, fingerprint, lambda t: [len(t)]
        )
        routed: list[list[int]] = []
        job.on_keys = routed.append  # the proxy's Router.record of the attempt
        info = FeatureInfo("t", "t", None, "local", False, 100, deferred_chars=len(prompt), deferred=job)
        return job, AttemptAudit(info, IndexAtDispatch(0, 0)), routed

    try:
        job, audit, routed = attempt(1)
        assert audit.kind == "deferred" and audit.waiting() and audit.full_keys is None
        await audit.encoded(0.05)  # not submitted: the wait ends at its bound, keys unknown
        assert audit.waiting() and audit.full_keys is None
        deferred.submit(job)
        await audit.encoded(10)
        assert not audit.waiting() and audit.full_keys is not None and routed == [audit.full_keys]
        assert audit.full_keys[0] > 200  # the keys_of of the whole prompt's tokens
        # a job the backlog drops never brings keys: the audit stops waiting for them
        dropped, audit2, _ = attempt(2)
        small = DeferredEncodes(DeferredLimits(10), lambda: None)
        small.submit(dropped)
        assert small.dropped == 1 and not audit2.waiting() and audit2.full_keys is None
        exact = FeatureInfo("t", "t", None, "local", False, 100)
        assert not AttemptAudit(exact, IndexAtDispatch(0, 0)).waiting()
    finally:
        await deferred.close()


async def test_upstream_stop_ends_the_audits_waiting_for_keys() -> None:
    """A late audit (one waiting for a deferred encode's keys) is the upstream's task: its
    ``stop`` cancels it, so nothing is left pending when the gateway shuts down."""
    index = PrefixIndex()
    fleet = Fleet(parse_config({"models": [{"name": "m", "block_size": 16}]}), index)
    upstream = Upstream(UpstreamClient(), fleet, GatewayMetrics(CollectorRegistry(), index, fleet, dict))
    never = asyncio.get_running_loop().create_future()
    # Upstream._audit starts a late audit in this set and nowhere else (the set's own contract:
    # tests/unit/test_asyncio_tasks.py)
    task = upstream._late_audits.start(asyncio.wait_for(never, LATE_AUDIT_S))
    await upstream.stop()
    assert task.cancelled() and len(upstream._late_audits) == 0


def test_blocks_the_prediction_took_as_evicted_and_the_engine_kept() -> None:
    """The snapshot expected the queue ahead to evict blocks 3.. before the prefill
    (``evicted_before_prefill``); the engine kept them: the estimate's doing, whatever the index."""
    index = _index()
    index.store("r", KEYS[:6])
    at = IndexAtDispatch.of(index, "r", KEYS, (3, 3))
    assert at == IndexAtDispatch(3, 0, 3)
    assert _cause(index, 3, 6, at) == "eviction_estimate"
    assert _cause(index, 3, 5, at) == "eviction_estimate"  # part of them kept
    index.remove("r", KEYS[2:3])  # and more than the estimate went: an over-prediction
    assert _cause(index, 3, 2, at) == "evicted"
