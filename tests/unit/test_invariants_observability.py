"""The stated invariants of the operator view's modules (and the status page) that no other test
enforced, or only in part, over seeded random operation sequences where they are about sequences;
each test quotes the module that states its invariant; those found false are ``xfail(strict)``
(tests/unit/test_invariants_routing.py: the same for the request path and the metrics)."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections import Counter as Tally
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request
from prometheus_client.core import HistogramMetricFamily

from gateway import operator_view, session_turns
from gateway.cache_lifetime import CacheLifetime
from gateway.inventory_ops import Op, OpKind
from gateway.log_histogram import LogHistogram
from gateway.operator_config import OperatorConfig, Price, TraceConfig
from gateway.operator_view import OperatorView
from gateway.request_outcome import Usage
from gateway.savings import MIN_SPEED_SAMPLES, PrefillSpeed
from gateway.session_turns import SessionTurns, _size
from gateway.status_page import StatusPage
from gateway.trace_recorder import BlockIdHasher, TraceRecorder
from tests.unit.test_operator_parts import Clock, outcome

SEEDS = [0, 1, 2]
KINDS: tuple[OpKind, ...] = ("s", "r", "c")  # store, remove, clear


def _chain(path: list[int]) -> list[int]:
    """Chained block keys of a token path: key i names the whole prefix up to block i."""
    return [hash(tuple(path[: i + 1])) & ((1 << 64) - 1) for i in range(len(path))]


class _Job:
    """What the view reads of a ``DeferredJob``: its callback and whether it is over."""

    def __init__(self) -> None:
        self.on_keys: Callable[[list[int]], None] | None = None
        self.over = False
        self.finished = SimpleNamespace(is_set=lambda: self.over)

    def end(self) -> None:
        self.on_keys, self.over = None, True


@pytest.mark.parametrize("seed", SEEDS)
def test_deferred_answers_and_early_keys_are_bounded_and_recorded_once(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """operator_view.py: ``_bounded_put`` keeps "at most ``MAX_DEFERRED`` entries"; a job "already
    over with no keys delivered [...] the request is recorded without them at once, and the job
    is not held"; an answer is recorded once, with its keys when they came before or after it."""
    monkeypatch.setattr(operator_view, "MAX_DEFERRED", 4)
    rng, view, recorded = random.Random(seed), OperatorView(OperatorConfig()), list[tuple[Any, Any]]()
    monkeypatch.setattr(view, "_keyed", lambda o: recorded.append((o.session_id, o.block_keys)))
    jobs, answered = dict[str, Any](), set[str]()  # the view keys them as ``DeferredJob``
    for step in range(400):
        before, op = len(recorded), rng.random()
        unanswered, live = [n for n in jobs if n not in answered], [n for n, j in jobs.items() if not j.over]
        if op < 0.3 or not jobs:
            job = jobs[f"j{step}"] = _Job()
            view.deferred(SimpleNamespace(info=SimpleNamespace(deferred=job)))  # type: ignore[arg-type]
        elif op < 0.65 and unanswered:
            name = rng.choice(unanswered)
            job, early = jobs[name], jobs[name] in view._early_keys
            answered.add(name)
            view._deferred_answered(job, outcome(session_id=name, block_keys=()))
            if early or job.over:  # recorded at once, with the keys that came first
                assert recorded[before:] == [(name, (hash(name),) if early else ())]
                assert job not in view._awaiting
            else:
                assert len(recorded) == before and job in view._awaiting
        elif live:
            job = jobs[name := rng.choice(live)]
            if rng.random() < 0.7:  # encoded: the keys come, then the job is over
                waiting = job in view._awaiting
                assert job.on_keys is not None
                job.on_keys([hash(name)])
                assert recorded[before:] == ([(name, (hash(name),))] if waiting else [])
            job.end()
        assert len(view._awaiting) <= 4 and len(view._early_keys) <= 4
        names = [n for n, _ in recorded]
        assert len(names) == len(set(names)) and set(names) <= answered
    assert view.failures == 0


def _attempt(rng: random.Random, tenant: str) -> Any:
    """An attempt answered on r0, a random score per replica (what ``outcome_of`` reads of it)."""
    scores, ns = {f"r{i}": rng.random() for i in range(rng.randint(1, 14))}, SimpleNamespace
    return ns(
        ctx=ns(parsed=ns(session_id=None, max_output_tokens=4), log={"ttft_ms": 10.0}, elapsed=lambda: 0.1,
               request=ns(headers={"x-t": tenant, "x-u": f"u-{tenant}"})),
        features=ns(model="m", prompt_tokens=64, block_keys=[1, 2, 3, 4], block_size=16),
        record=ns(id="r0"), info=ns(exact=True, approximate=False, deferred=None),
        choice=ns(predicted_tokens=32, decision=ns(scores=scores, reason="kv", matched_blocks=2)),
    )  # fmt: skip


def test_recent_decisions_keep_their_best_scores_and_a_reload_applies_at_once() -> None:
    """operator_view.py: the last ``RECENT_DECISIONS`` decisions, each with "the best-scored
    replicas" (``MAX_SCORES``); ``reconfigure``: "prices, the tenant bound and the tenant header
    apply at once" (savings.py: prices "are applied when the report is read, so a reload
    reprices everything")."""
    rng = random.Random(3)
    view = OperatorView(OperatorConfig(tenant_header="x-t", prices={"m": Price(input=2.0, cached_input=1.0)}))
    use = Usage(64, 4, 32)
    for i in range(2 * operator_view.RECENT_DECISIONS + 7):
        a = _attempt(rng, f"t{i % 3}")
        view.answered(a, use)
        assert len(view.decisions) == min(i + 1, operator_view.RECENT_DECISIONS)
        best = sorted(a.choice.decision.scores.values(), reverse=True)[: operator_view.MAX_SCORES]
        assert sorted(view.decisions[-1]["scores"].values(), reverse=True) == [round(s, 4) for s in best]
    saved = view.report()["savings"]["totals"]["saved_usd"]
    prices = {"m": Price(input=5.0, cached_input=1.0)}
    view.reconfigure(OperatorConfig(tenant_header="x-u", max_tenants=4, prices=prices))
    assert view.report()["savings"]["totals"]["saved_usd"] == pytest.approx(4 * saved)  # repriced
    view.answered(_attempt(rng, "t9"), use)  # the new header names it: the fourth tenant
    view.answered(_attempt(rng, "t8"), use)  # the new bound: a fifth is "other"
    assert {r["tenant"] for r in view.report()["savings"]["rows"]} == {"t0", "t1", "t2", "u-t9", "other"}
    assert view.failures == 0


async def test_a_client_cannot_choose_the_trace_file(tmp_path: Path) -> None:
    """operator_view.py: ``POST /admin/trace`` starts "recording to ``operator.trace.path``; a
    client cannot choose the file"."""
    mine, theirs = tmp_path / "t.jsonl", tmp_path / "theirs.jsonl"
    view = OperatorView(OperatorConfig(trace=TraceConfig(path=str(mine))))
    body = json.dumps({"enabled": True, "path": str(theirs)}).encode()
    resp = await view.trace_toggle(SimpleNamespace(read=lambda: asyncio.sleep(0, body)))  # type: ignore[arg-type]
    view.recorder.stop()
    assert resp.status == 200 and json.loads(resp.body)["path"] == str(mine)  # type: ignore[attr-defined]
    assert mine.exists() and not theirs.exists()


@pytest.mark.parametrize("falling", [False, True])
def test_prefill_speed_waits_for_its_samples_and_is_never_negative(falling: bool) -> None:
    """savings.py, ``seconds_per_token``: "None before ``MIN_SPEED_SAMPLES``", then a slope
    clamped at 0 (time to first token that falls with the prompt size is queueing, not a
    negative prefill time)."""
    rng, speed = random.Random(int(falling)), PrefillSpeed()
    for i in range(60):
        x = rng.randint(0, 4000)
        speed.add(x, 1.0 - 1e-4 * x + rng.uniform(0, 0.01) if falling else 0.05 + 2e-4 * x)
        spt = speed.seconds_per_token()
        if i + 1 < MIN_SPEED_SAMPLES:
            assert spt is None
        else:
            assert spt == (0.0 if falling else pytest.approx(2e-4))


@pytest.mark.parametrize("seed", SEEDS)
def test_sessions_stay_within_their_bytes_the_least_recent_go_and_every_turn_is_judged(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """session_turns.py: the previous turn's keys, "at most ``MAX_KEYS_PER_SESSION``", are kept
    "up to ``max_bytes`` over all sessions, the least recently seen dropped first"; a returning
    turn's prefix is ``alive`` when a replica held its deepest block "stored before the arrival"
    (or "held since a snapshot"), else ``evicted`` (every replica observed, no record dropped)."""
    monkeypatch.setattr(session_turns, "MAX_KEYS_PER_SESSION", 6)
    rng, clock, keys = random.Random(seed), Clock(), [b * 100 + i for b in range(3) for i in range(10)]
    lt = CacheLifetime(10_000, clock=clock)
    lt.inventory_snapshot("r0", {})
    max_bytes = 4 * (session_turns.SESSION_OVERHEAD_BYTES + 8 * 6)
    turns = SessionTurns(lt, max_bytes, fleet_replicas=lambda: ["r0"])
    prompts: dict[str, tuple[int, ...]] = {}
    want = Tally[str]()
    for _ in range(500):
        clock.t += 1.0
        if rng.random() < 0.5:
            lt.inventory_ops("r0", [Op(rng.choice(KINDS[:2]), rng.sample(keys, rng.randint(1, 12)))])
            continue
        if rng.random() < 0.05:
            lt.inventory_snapshot("r0", dict.fromkeys(rng.sample(keys, 10), "gpu"))
        sid, base, arrival = f"s{rng.randrange(9)}", rng.randrange(3), clock.t - rng.uniform(0.0, 3.0)
        mine = tuple(base * 100 + i for i in range(rng.randint(1, 10)))
        order, sizes = list(turns._last), {s: _size(v) for s, v in turns._last.items()}
        state = turns.turn(outcome(session_id=sid, block_keys=mine, arrival=arrival, done=clock.t), "t")
        if sid in order:  # a returning turn: its prefix shared with the last turn, judged at arrival
            prev = prompts[sid]
            depth = min(len(prev), len(mine), 6) if prev[0] // 100 == base else 0
            held, stored = lt.store_time("r0", mine[depth - 1]) if depth else (False, None)
            alive = held and (stored is None or stored <= arrival)
            assert state == ("no_prefix" if not depth else "alive" if alive else "evicted")
            want[state] += 1
        else:
            assert state is None
        prompts[sid] = mine[:6]
        seen = [s for s in order if s != sid] + [sid]  # least recently seen first
        kept = list(turns._last)
        assert kept == seen[len(seen) - len(kept) :]  # the most recently seen stay
        assert turns._bytes == sum(_size(v) for v in turns._last.values()) <= max_bytes
        assert all(len(v.keys) <= 6 for v in turns._last.values())
        if len(kept) < len(seen):  # one went only when it did not fit
            assert turns._bytes + sizes[seen[len(seen) - len(kept) - 1]] > max_bytes
    got = turns.report()["all"]
    named = {"alive": "prefix_alive", "evicted": "prefix_evicted", "no_prefix": "no_shared_prefix"}
    assert {state: got[name] for state, name in named.items()} == want and min(want.values()) > 0
    assert got["returning_turns"] == sum(want.values())


@pytest.mark.parametrize("seed", SEEDS)
def test_store_times_and_depths_stay_within_the_bound_the_written_replica_losing_its_oldest(
    seed: int,
) -> None:
    """cache_lifetime.py: "at most ``max_tracked_blocks`` store times over all replicas (the
    oldest store of the replica being written is dropped first, counted in ``dropped``); depths
    share the same bound", over stores, removes, clears, snapshots and depth notes."""
    rng, clock, bound = random.Random(seed), Clock(), 40
    lt = CacheLifetime(bound, clock=clock)
    for _ in range(500):
        clock.t += rng.random()
        rid, op, dropped = rng.choice(["r0", "r1", "r2"]), rng.random(), lt.dropped
        mine, keys = list(lt._stored.get(rid, ())), rng.sample(range(200), rng.randint(1, 30))
        others, order = lt._held - len(mine), list[int]()  # ``order``: the written replica's, unbounded
        if op < 0.5:
            lt.inventory_ops(rid, [Op("s", keys)])
            order = mine + [k for k in keys if k not in mine]
        elif op < 0.8:
            lt.inventory_ops(rid, [Op(rng.choice(KINDS[1:]), keys)])
        elif op < 0.9:  # unknown store times first (snapshot order), then the known oldest first
            snap, times = rng.sample(range(200), rng.randint(0, 60)), dict(lt._stored.get(rid, {}))
            order = [k for k in snap if times.get(k) is None] + [k for k in times if times[k] and k in snap]
            lt.inventory_snapshot(rid, dict.fromkeys(snap, "gpu"))
        else:
            lt.note_depths(rng.sample(range(10_000), rng.randint(1, 80)))
        held = sum(len(b) for b in lt._stored.values())
        assert lt._held == held == lt.report()["tracked_blocks"] and held <= bound >= len(lt._depths)
        over = max(0, others + len(order) - bound)
        assert lt.dropped - dropped == over
        if order and over <= len(order):  # the replica being written lost its oldest
            assert list(lt._stored[rid]) == order[over:]


def test_store_times_stay_oldest_first_across_a_snapshot() -> None:
    """cache_lifetime.py: store times oldest first, also after a snapshot listing keys in another
    order (found false: it rebuilt the records in the snapshot's order)."""
    clock = Clock()
    lt = CacheLifetime(2, clock=clock)
    lt.inventory_ops("r0", [Op("s", [1])])
    clock.t += 10
    lt.inventory_ops("r0", [Op("s", [2])])
    clock.t += 10
    lt.inventory_snapshot("r0", {2: "gpu", 1: "gpu"})
    times = [t for t in lt._stored["r0"].values() if t is not None]
    assert lt.report()["replicas"]["r0"]["oldest_held_age_s"] == 20.0
    assert times == sorted(times)


@pytest.mark.parametrize("seed", SEEDS)
def test_each_noted_key_has_its_position_in_the_prompt(seed: int) -> None:
    """cache_lifetime.py, ``note_depths``: "key i is at depth i"; only the keys after the deepest
    known one are noted, which is right because "a chained key's depth is a property of the
    key" (resent, extended and branching prompts)."""
    rng = random.Random(seed)
    lt = CacheLifetime(100_000)
    paths: list[list[int]] = [[]]
    for _ in range(300):
        path = rng.choice(paths)[: rng.randint(0, 40)] + [rng.randrange(3) for _ in range(rng.randint(0, 20))]
        paths.append(path)
        keys = _chain(path)
        lt.note_depths(keys)
        assert [lt._depths[k] for k in keys] == list(range(len(keys)))


def _agrees(h: LogHistogram, sample: list[float]) -> None:
    def upper(v: float) -> float:  # the bound of the bucket holding v
        return next((b for b in h.bounds if v <= b), math.inf)

    assert len(h.counts) == len(h.bounds) + 1 and h.count == len(sample)
    assert h.total == pytest.approx(sum(sample))
    ordered, n = sorted(sample), len(sample)
    for q in (0.0, 0.01, 0.3, 0.5, 0.9, 0.99, 1.0):
        assert h.quantile(q) == (upper(ordered[max(1, math.ceil(q * n)) - 1]) if n else None), q
    for v in (0.05, 0.1, 3.0, 60.0, 1e5):
        assert h.share_above(v) == (sum(x > upper(v) for x in sample) / n if n else None), v


@pytest.mark.parametrize("seed", SEEDS)
def test_a_histogram_agrees_with_its_raw_sample(seed: int) -> None:
    """log_histogram.py: "Fixed memory: one count per bucket"; ``quantile``: "the upper bound of
    the bucket holding quantile ``q``"; ``share_above``: "the share of observations above the
    bucket bound at or above ``value``"; ``merged`` and ``add_to`` count the same sample."""
    rng, hists, samples = (
        random.Random(seed),
        (LogHistogram(), LogHistogram()),
        (list[float](), list[float]()),
    )
    for _ in range(40):
        i, pick = rng.randrange(2), [*hists[0].bounds, 0.0, 1e6, rng.uniform(0, 1e5), rng.expovariate(0.1)]
        values = [rng.choice(pick) for _ in range(rng.randint(0, 20))]
        hists[i].observe_many(values)
        samples[i].extend(values)
        for h, sample in zip(hists, samples, strict=True):
            _agrees(h, sample)
    merged, sample = hists[0].merged(hists[1]), samples[0] + samples[1]
    _agrees(merged, sample)
    family = HistogramMetricFamily("x", "x", labels=["l"])
    merged.add_to(family, ["v"])
    got = {s.labels["le"]: s.value for s in family.samples if s.name == "x_bucket"}
    assert got == {**{str(b): sum(v <= b for v in sample) for b in merged.bounds}, "+Inf": len(sample)}


@pytest.mark.parametrize("seed", SEEDS)
def test_trace_lines_keep_arrival_order_and_their_timestamps_never_decrease(
    seed: int, tmp_path: Path
) -> None:
    """trace_recorder.py: "one JSON line per answered request, in arrival order"; "a line is held
    until it arrived more than ``reorder_window_s`` ago (or the held lines exceed
    ``max_pending_bytes``)"; a late line "carries the latest written timestamp (counted as
    ``late``), so the file's timestamps never decrease"; ids "match exactly when their prefixes
    do"; ``start``: "a new recording starts at timestamp 0"; ``stop``: "write every held line"."""
    rng, clock, path, history = random.Random(seed), Clock(), tmp_path / "t.jsonl", [list[int]()]
    recordings, rec = [], TraceRecorder(TraceConfig(salt="k"), clock)
    for bound in (10**9, 1500, 600):  # the first recording never flushes on bytes
        cfg = TraceConfig(path=str(path), max_bytes=3000, keep_files=300, reorder_window_s=2.0,
                          max_pending_bytes=bound, salt="k")  # fmt: skip
        rec._cfg = cfg  # one recorder records again and again (its bound changed)
        rec.start()
        # per hashed session id: arrival, step and keys; per line written: the step and its time
        t0, added, written = (
            clock.t,
            dict[str, tuple[float, int, tuple[int, ...]]](),
            list[tuple[int, float]](),
        )
        for step in range(150):
            clock.t += rng.choice([0.0, 0.1, 0.5, 1.5, 3.0])
            acted = rng.random() < 0.9
            if acted and rng.random() < 0.85:
                tokens = rng.choice(history)[: rng.randint(0, 8)] + rng.choices(range(3), k=rng.randint(1, 4))
                keys, size = (
                    tuple(_chain(tokens)) if rng.random() < 0.9 else (),
                    16 * len(tokens) + rng.randrange(16),
                )
                arrival, sid = max(t0, clock.t - rng.uniform(0.0, 4.0)), f"q{seed}.{bound}.{step}"
                added[BlockIdHasher("k").session(sid)] = (arrival, step, keys)
                history.append(tokens)
                rec.add(outcome(arrival=arrival, session_id=sid, block_keys=keys, gateway_prompt_tokens=size))
                acted = bool(keys)  # a skipped request writes nothing
            elif acted:
                rec.flush()
            assert rec._pending_bytes <= bound
            if acted:  # an add or a flush writes every line old enough
                assert all(arrival > clock.t - 2.0 for arrival, _, _ in rec._pending)
            written += [(step, clock.t)] * (rec.stats.lines - len(written))
        rec.stop()
        assert rec._pending == [] and rec.stats.lines + rec.stats.skipped.get("approximate", 0) == len(added)
        written += [(150, math.inf)] * (rec.stats.lines - len(written))  # by ``stop``
        recordings.append((t0, added, written, rec.stats.late, bound))
    files = sorted(tmp_path.iterdir(), key=lambda p: -int(p.suffix[1:]) if p.suffix != ".jsonl" else 0)
    assert 3 < len(files) < cfg.keep_files  # rotated, none deleted
    lines, ids = [json.loads(x) for f in files for x in f.read_text().splitlines()], dict[int, int]()
    for t0, added, written, late, bound in recordings:
        mine, lines = lines[: len(written)], lines[len(written) :]
        last, lates = 0.0, 0
        for i, line in enumerate(mine):
            arrival, step, keys = added[line["session_id"]]
            raw = round((arrival - t0) * 1000, 3)
            lates, last = lates + (raw < last), max(raw, last)
            assert line["timestamp"] == last  # the latest written one when late: never decreasing
            assert bound < 10**9 or arrival <= written[i][1] - 2.0  # written once old enough
            for j in range(i):  # a line before an earlier arrival went before that one was added
                assert added[mine[j]["session_id"]][0] <= arrival or written[j][0] < step
            for key, block_id in zip(keys, line["hash_ids"], strict=True):
                assert ids.setdefault(block_id, key) == key and block_id < 1 << 63
        assert lates == late
    assert lines == [] and len(set(ids.values())) == len(ids)


async def test_the_status_page_serves_the_files_read_at_start_up(tmp_path: Path) -> None:
    """status_page.py: "Files are read once, at start-up"."""
    for name, text in (("status.html", "<p>one</p>"), ("status.js", "one();")):
        (tmp_path / name).write_text(text)
    page, request = StatusPage(tmp_path), make_mocked_request("GET", "/status")
    (tmp_path / "status.html").write_text("<p>two</p>")
    (tmp_path / "status.js").unlink()
    assert (await page.page(request)).body == b"<p>one</p>"  # type: ignore[attr-defined]
    assert (await page.script(request)).body == b"one();"  # type: ignore[attr-defined]
