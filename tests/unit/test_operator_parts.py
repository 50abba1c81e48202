"""The operator view's parts on their own: the trace recorder (order, bounds, rotation, format),
the savings ledger (prices, prefill-speed slope, tenant bound), block lifetimes and session turns."""

from __future__ import annotations

import dataclasses
import gc
import random
import weakref
from pathlib import Path

import pytest

from gateway.cache_lifetime import DEPTH_BUCKETS, CacheLifetime, depth_label
from gateway.features.deferred_job import DeferredJob
from gateway.features.segment_encoder import BoundedLRU, SegmentEncoder
from gateway.features.tokenizer_files import load_tokenizer_files
from gateway.inventory_ops import Op
from gateway.log_histogram import LogHistogram
from gateway.operator_config import PUBLISHED_PRICES, OperatorConfig, Price, TraceConfig
from gateway.operator_view import OperatorView
from gateway.report_cli import render
from gateway.request_outcome import Outcome, tenant_label, usage_in
from gateway.savings import PrefillSpeed, SavingsLedger
from gateway.session_turns import SessionTurns
from gateway.trace_recorder import TraceRecorder
from router_policies.sim.traces import load_trace


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def outcome(**kw: object) -> Outcome:
    base = Outcome(
        arrival=100.0,
        done=100.5,
        model="m",
        tenant="t1",
        session_id="s1",
        replica="r0",
        prompt_tokens=64,
        gateway_prompt_tokens=64,
        completion_tokens=8,
        cached_tokens=32,
        predicted_tokens=32,
        ttft_s=0.1,
        block_keys=(11, 12, 13, 14),
        block_size=16,
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- trace recorder
def test_recorder_writes_arrival_order_and_the_simulator_reads_it(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(TraceConfig(path=str(path), reorder_window_s=5.0, salt="k"), clock)
    rec.start()
    clock.t = 102.0
    rec.add(outcome(arrival=101.0, session_id="b"))  # finished first, arrived second
    rec.add(outcome(arrival=100.5, session_id="a"))
    assert rec.stats.lines == 0  # held for the reorder window
    clock.t = 107.0
    rec.flush()
    assert rec.stats.lines == 2
    rec.add(outcome(arrival=100.7))  # arrives after a later line was written: clamped, counted late
    rec.stop()
    trace = load_trace(path)
    assert [r.timestamp_ms for r in trace.requests] == [500.0, 1000.0, 1000.0]
    assert rec.stats.late == 1
    assert trace.block_size == 16 and all(len(r.hash_ids) == 4 for r in trace.requests)
    # keyed hash: equal keys give equal ids, never the raw keys, and sessions are hashed too
    assert trace.requests[0].hash_ids == trace.requests[1].hash_ids
    assert not set(trace.requests[0].hash_ids) & {11, 12, 13, 14}
    assert trace.requests[0].session_id not in ("a", "b", None)


def test_recorder_rotates_and_bounds_files(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(TraceConfig(path=str(path), max_bytes=400, keep_files=2, reorder_window_s=0), clock)
    rec.start()
    for i in range(40):
        clock.t += 1
        rec.add(outcome(arrival=clock.t - 0.5, session_id=f"s{i}"))
    rec.stop()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    assert rec.stats.rotations > 2
    for p in tmp_path.iterdir():
        lines = p.read_bytes().splitlines(keepends=True)
        if lines:  # the current file may be empty right after a rotation
            assert p.stat().st_size <= 400 + max(len(x) for x in lines)
            load_trace(p)


def test_recorder_skips_approximate_and_restarts_at_zero(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(TraceConfig(path=str(path), reorder_window_s=0), clock)
    rec.start()
    rec.add(outcome(block_keys=()))
    rec.add(outcome(gateway_prompt_tokens=200))  # 4 keys cannot cover 200 tokens of 16
    clock.t = 101.0
    rec.add(outcome(arrival=100.5))
    rec.stop()
    assert rec.stats.skipped == {"approximate": 1, "inconsistent": 1}
    rec.start()  # a new recording: the old file is rotated out, timestamps start again
    assert (tmp_path / "t.jsonl.1").exists()
    rec.stop()


def test_trace_config_needs_a_path_when_enabled() -> None:
    with pytest.raises(ValueError, match="path"):
        TraceConfig(enabled=True)


# ---------------------------------------------------------------------- savings
def test_prefill_speed_is_the_slope_not_the_queueing() -> None:
    s = PrefillSpeed()
    for x in range(0, 2000, 100):
        s.add(x, 0.05 + 2e-4 * x)  # 50 ms of queueing and network, 0.2 ms per computed token
    assert s.seconds_per_token() == pytest.approx(2e-4, rel=1e-6)
    flat = PrefillSpeed()
    for _ in range(20):
        flat.add(100, 0.1)
    assert flat.seconds_per_token() is None  # no spread in sizes: no slope


def test_savings_rows_price_the_engine_cached_tokens() -> None:
    cfg = OperatorConfig(prices={"m": Price(input=2.0, cached_input=0.5)}, gpus_per_replica=4, max_tenants=1)
    ledger = SavingsLedger(cfg)
    for i in range(10):
        ledger.record(
            outcome(prompt_tokens=100 + 100 * i, cached_tokens=50, ttft_s=0.01 + 1e-3 * (50 + 100 * i))
        )
    ledger.record(outcome(tenant="t2", cached_tokens=10, ttft_s=None))
    ledger.record(outcome(cached_tokens=None))
    rows = {r["tenant"]: r for r in ledger.rows()}
    assert set(rows) == {"t1", "other"}  # max_tenants=1
    t1 = rows["t1"]
    assert t1["saved_prefill_tokens"] == 500
    assert t1["saved_usd"] == pytest.approx(500 * 1.5 / 1e6)
    assert t1["cost_usd"] == pytest.approx(((t1["prompt_tokens"] - 500) * 2.0 + 500 * 0.5) / 1e6)
    assert t1["saved_engine_s"] == pytest.approx(500 * 1e-3)
    assert t1["saved_gpu_s"] == pytest.approx(4 * 500 * 1e-3)
    totals = ledger.totals(list(rows.values()))
    assert totals["requests_without_usage"] == 1 and totals["saved_prefill_tokens"] == 510


def test_unpriced_models_count_tokens_without_money() -> None:
    ledger = SavingsLedger(OperatorConfig())
    ledger.record(outcome(model="unknown-model"))
    (row,) = ledger.rows()
    assert row["saved_prefill_tokens"] == 32 and row["saved_usd"] is None
    assert ledger.totals([row])["unpriced_models"] == ["unknown-model"]
    assert all("2026-12-01" in p.source for p in PUBLISHED_PRICES.values())
    with pytest.raises(ValueError):
        Price(input=1.0, cached_input=2.0)


def test_usage_parsing_and_tenant_labels() -> None:
    body = b'{"usage": {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}}'
    u = usage_in(body, sse=False)
    assert u is not None and (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (10, 3, 4)
    tail = b'data: {"choices": []}\n\ndata: ' + body + b"\n\ndata: [DONE]\n\n"
    assert usage_in(tail, sse=True) == u
    assert usage_in(b"not json", sse=False) is None
    assert tenant_label(None) == "default" and len(tenant_label("x" * 500)) == 64


# ---------------------------------------------------------------------- lifetimes and turns
def test_residency_from_store_and_remove_events_bounded() -> None:
    clock = Clock()
    lt = CacheLifetime(max_tracked_blocks=3, clock=clock)
    lt.note_depths([1, 2, 3])
    lt.inventory_ops("r0", [Op("s", [1, 2, 3])])
    clock.t += 30
    lt.inventory_ops("r0", [Op("r", [1, 3]), Op("r", [99])])
    assert lt.residency["r0"].count == 2 and lt.residency["r0"].quantile(0.5) == 30.0
    assert set(lt.by_depth) == {depth_label(0)}
    lt.inventory_ops("r1", [Op("s", [5, 6, 7, 8])])  # over the bound: the oldest store goes
    assert lt.report()["tracked_blocks"] == 3 and lt.dropped == 2
    assert lt.store_time("r1", 5) == (False, None) and lt.store_time("r0", 2)[0]
    lt.inventory_snapshot("r2", {40: "gpu"})  # snapshot keys: no store time, no residency on removal
    lt.inventory_ops("r2", [Op("r", [40])])
    assert "r2" not in lt.residency
    lt.inventory_ops("r1", [Op("c")])
    assert lt.store_time("r1", 8) == (False, None)


def test_turn_after_eviction_is_told_from_one_whose_prefix_lived() -> None:
    clock = Clock()
    lt = CacheLifetime(1000, clock=clock)
    turns = SessionTurns(lt, max_bytes=10_000)
    first = outcome(arrival=100.0, done=100.5, block_keys=(1, 2))
    lt.inventory_ops("r0", [Op("s", [1, 2])])
    assert turns.turn(first, "t1") is None
    # the second turn extends the first; its prefix (1, 2) is still held: alive, and a hit
    second = outcome(arrival=103.0, done=103.5, block_keys=(1, 2, 3), cached_tokens=32)
    assert turns.turn(second, "t1") == "alive"
    clock.t = 110.0
    lt.inventory_ops("r0", [Op("r", [2, 3])])
    third = outcome(arrival=120.0, done=121.0, block_keys=(1, 2, 3, 4), cached_tokens=16)
    assert turns.turn(third, "t1") == "evicted"
    # recomputed by the turn itself (stored after its arrival): still evicted at arrival
    clock.t = 130.0
    lt.inventory_ops("r0", [Op("s", [2, 3, 4])])
    fourth = outcome(arrival=129.0, done=131.0, block_keys=(1, 2, 3, 4, 5), cached_tokens=16)
    assert turns.turn(fourth, "t1") == "evicted"
    rep = turns.report()
    assert rep["all"]["returning_turns"] == 3 and rep["all"]["prefix_evicted"] == 2
    assert rep["all"]["engine_missed"] == 2  # cached 16 < the 48- and 64-token prefixes
    assert rep["turn_gap"]["count"] == 3


def test_log_histogram_quantiles() -> None:
    h = LogHistogram()
    for v in (0.2, 0.3, 4.0, 100.0):
        h.observe(v)
    assert h.quantile(0.5) == 0.5 and h.quantile(1.0) == 120.0
    assert h.share_above(5.0) == 0.25
    assert LogHistogram().quantile(0.5) is None


def test_session_memory_is_bounded_in_bytes() -> None:
    lt = CacheLifetime(1000)
    turns = SessionTurns(lt, max_bytes=3 * (200 + 8 * 4))
    for i in range(10):
        turns.turn(outcome(session_id=f"s{i}", block_keys=(1, 2, 3, 4)), "t1")
    rep = turns.report()
    assert rep["sessions_tracked"] == 3 and rep["session_bytes"] <= 3 * (200 + 8 * 4)
    # the oldest sessions went: their next turn counts as a first turn
    assert turns.turn(outcome(session_id="s0", block_keys=(1, 2, 3, 4, 5)), "t1") is None
    assert turns.turn(outcome(session_id="s9", block_keys=(1, 2, 3, 4, 5)), "t1") is not None


def test_an_empty_report_renders(capsys: pytest.CaptureFixture[str]) -> None:
    render(OperatorView(OperatorConfig()).report())
    out = capsys.readouterr().out
    assert "TOTAL" in out and "not recording" in out


def test_a_failure_in_the_view_never_reaches_the_request(caplog: pytest.LogCaptureFixture) -> None:
    view = OperatorView(OperatorConfig())
    view.answered(None, None)  # type: ignore[arg-type]  # an attempt it cannot read
    assert view.failures == 1 and view.report()["failures"] == 1
    assert "recording an answered request failed" in caplog.text


def test_unobserved_replicas_or_dropped_records_make_a_turn_unknown() -> None:
    clock = Clock()
    lt = CacheLifetime(1000, clock=clock)
    fleet = ["r0", "r1"]
    turns = SessionTurns(lt, max_bytes=10_000, fleet_replicas=lambda: fleet)
    lt.inventory_ops("r0", [Op("s", [7])])
    turns.turn(outcome(session_id="a", block_keys=(1, 2)), "t1")
    # r1 sends its events elsewhere: a prefix not found on r0 may live there
    assert turns.turn(outcome(session_id="a", block_keys=(1, 2, 3)), "t1") == "unknown"
    lt.inventory_ops("r1", [Op("s", [8])])
    assert turns.turn(outcome(session_id="a", block_keys=(1, 2, 3, 4)), "t1") == "evicted"
    small = CacheLifetime(1, clock=clock)
    small.inventory_ops("r0", [Op("s", [1, 2])])  # one store record dropped
    t2 = SessionTurns(small, max_bytes=10_000)
    t2.turn(outcome(session_id="b", block_keys=(5, 6)), "t1")
    assert t2.turn(outcome(session_id="b", block_keys=(5, 6, 9)), "t1") == "unknown"


def test_a_deferred_answer_whose_job_is_over_is_recorded_at_once_and_the_job_not_held() -> None:
    """A job over without keys (dropped from the backlog, or encoded before the attempt could
    listen) will deliver none: the answer is recorded then, not parked holding the job."""
    tok = load_tokenizer_files(
        Path(__file__).resolve().parents[2] / "assets/tokenizers/kvgate-tiny", where="t"
    )
    enc = SegmentEncoder(tok.tokenizer, BoundedLRU(10), "t")

    def job(fingerprint: int) -> DeferredJob:
        return DeferredJob(
            enc,
            enc.plan("some new text " * 20, add_special_tokens=False),
            False,
            fingerprint,
            lambda t: [len(t)],
        )

    view = OperatorView(OperatorConfig())
    waiting = job(1)
    view._deferred_answered(waiting, outcome(session_id="waits"))
    assert view.turns.report()["sessions_tracked"] == 0  # parked until its keys come
    over = job(2)
    over.end()
    view._deferred_answered(over, outcome(session_id="over"))
    assert view.turns.report()["sessions_tracked"] == 1
    ref = weakref.ref(over)
    del over
    gc.collect()
    assert ref() is None  # the view holds no finished job


def test_a_remove_events_residencies_are_those_of_its_blocks_one_by_one() -> None:
    """Removals are counted per event (``observe_many``, labels looked up): the histograms are
    those of observing each removed block alone, in order, at every depth bucket."""
    rng = random.Random(5)
    clock = Clock()
    lt = CacheLifetime(10_000, clock=clock)
    want: dict[str, LogHistogram] = {}
    want_depth: dict[str, LogHistogram] = {}
    stored: dict[int, float] = {}
    prompt = rng.sample(range(700), 500)  # depths 0-499 (every bucket); 500 keys of none
    lt.note_depths(prompt)
    depth = {k: i for i, k in enumerate(prompt)}
    for _ in range(200):
        clock.t += rng.choice([0.05, 0.3, 2.0, 40.0, 700.0])
        keys = rng.sample(range(700), rng.randint(1, 40))
        if rng.random() < 0.5:
            lt.inventory_ops("r0", [Op("s", keys)])
            for k in keys:
                stored.setdefault(k, clock.t)
        else:
            lt.inventory_ops("r0", [Op("r", keys)])
            for k in keys:
                if k in stored:
                    lived = clock.t - stored.pop(k)
                    want.setdefault("r0", LogHistogram()).observe(lived)
                    # the bucket searched here, not looked up as the record does
                    label = (
                        next((f"{lo}" for lo, hi in DEPTH_BUCKETS if lo <= depth[k] <= hi), "")
                        if k in depth
                        else "unknown"
                    )
                    want_depth.setdefault(label, LogHistogram()).observe(lived)
    assert {r: (h.counts, h.count, h.total) for r, h in lt.residency.items()} == {
        r: (h.counts, h.count, h.total) for r, h in want.items()
    }
    lows = {depth_label(lo): f"{lo}" for lo, _ in DEPTH_BUCKETS} | {"unknown": "unknown"}
    assert {lows[d]: (h.counts, h.total) for d, h in lt.by_depth.items()} == {
        d: (h.counts, h.total) for d, h in want_depth.items()
    }
    assert set(want_depth) == {*(f"{lo}" for lo, _ in DEPTH_BUCKETS), "unknown"}
    assert lt.removals == sum(h.count for h in want.values())


def test_depth_labels_name_their_bucket() -> None:
    cases = {0: "0-3", 3: "0-3", 4: "4-15", 15: "4-15", 16: "16-63", 255: "64-255", 256: "256+"}
    assert {d: depth_label(d) for d in cases} == cases
    assert depth_label(10**6) == "256+"
    assert depth_label(None) == depth_label(-1) == "unknown"
