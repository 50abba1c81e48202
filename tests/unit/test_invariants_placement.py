"""The invariants stated in router_policies' placement glue (flights, placement, ttft_feed,
ttft/freshness, sim/sim_gateway), each checked by a property over seeded random operation
sequences (the house rule: an invariant a comment states holds because a test or an assert says
so). Each test names the docstring it enforces."""

from __future__ import annotations

import ast
import itertools
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from router_policies import placement, ttft_feed
from router_policies.cache_prediction import evicted_before_prefill
from router_policies.flights import Flight, FlightCounters
from router_policies.placement import Candidate, Dispatch, IndexView, ReplicaLoad, TtftFeed
from router_policies.policy import ReplicaState, RequestFeatures, RoomSchedule
from router_policies.prefix_index import IndexConfig, PrefixIndex
from router_policies.registry import build_policy
from router_policies.sim.sim_gateway import SimGateway
from router_policies.ttft import freshness
from router_policies.ttft.features import predict
from router_policies.ttft.freshness import Freshness
from router_policies.ttft.params import DEFAULT_PRIOR, TtftParams
from tests.unit.test_invariants_index import ChainTree, index_of

REPO = Path(__file__).resolve().parents[2]
BS = 16


# ---------------------------------------------------------------------- flights.py
@dataclass
class _Open:
    flight: Flight
    keys: list[int]
    cached: list[int]
    prefill_open: bool = True
    open: bool = True


@dataclass
class _Run:
    counters: FlightCounters = field(default_factory=FlightCounters)
    flights: list[_Open] = field(default_factory=list)
    now: float = 0.0
    decoding: set[int] = field(default_factory=set)  # ids of the flights with a timed first byte


def _random_flights(seed: int, steps: int) -> Iterator[tuple[_Run, random.Random, ChainTree]]:
    """A random interleaving of flight starts (prompts sharing prefixes, a cached part), first
    bytes (with and without a time, repeated) and ends (repeated, with and without a time) on one
    replica's counters, through ``TtftFeed.flight``; yields after every step."""
    rng = random.Random(seed)
    tree = ChainTree(rng, 30)
    feed = TtftFeed()
    run = _Run()
    now = 0.0
    for _ in range(steps):
        now += rng.choice([0.0, 0.01, 0.2])
        run.now = now
        op = rng.random()
        if op < 0.4 or not run.flights:
            keys = tree.path(rng.choice(tree.keys)) if rng.random() < 0.9 else []
            prompt = len(keys) * BS + rng.choice([0, 0, 5])
            cached = BS * rng.randint(0, len(keys))
            d = Dispatch(ReplicaState("r"), prompt, cached, BS, rng.randint(0, 30), keys)
            f = feed.flight(run.counters, d, start=now if rng.random() < 0.8 else None)
            run.flights.append(_Open(f, keys, list(f.cached_keys)))
        else:
            o = rng.choice(run.flights)
            if op < 0.7:
                timed = rng.random() < 0.7
                if timed and o.prefill_open and o.open and o.flight.output:
                    run.decoding.add(id(o.flight))
                o.flight.first_byte(now if timed else None)
                o.prefill_open = False
            else:
                o.flight.end(now if rng.random() < 0.5 else None)
                o.prefill_open = o.open = False
                run.decoding.discard(id(o.flight))
        yield run, rng, tree


def test_flights_release_exactly_what_they_added_and_the_counters_return_to_zero() -> None:
    """flights.py, "Invariants": a Flight releases exactly what it added, ``first_byte`` and
    ``end`` are idempotent, so the counters return to zero when every flight ended; and
    FlightCounters' comments: ``shared_tokens`` counts the cached blocks held more than once
    (``tokens - shared_tokens`` is what they pin), ``_pending_starts``' first entry is the
    oldest pending start, ``prompt_keys`` are the flights in progress'."""
    for seed in range(20):
        run = _Run()
        for run, _, _ in _random_flights(seed, 80):
            c, fl = run.counters, run.flights
            live = [o for o in fl if o.open]
            pending = [o for o in fl if o.prefill_open]
            assert c.requests == len(live) and c.started == len(fl)
            assert c.tokens == sum(o.flight.tokens for o in live)
            assert c.pending_prefill_tokens == sum(o.flight.prefill for o in pending)
            assert c.pending_prefill_pairs == pytest.approx(sum(o.flight.pairs for o in pending))
            if not c.pending_prefill_tokens:
                assert c.pending_prefill_pairs == 0.0  # no float residue
            refs = Counter(k for o in live for k in o.cached)
            assert set(c.held_keys()) == set(refs)
            assert c.shared_tokens == BS * sum(n - 1 for n in refs.values())
            assert [list(p) for p in c.prompt_keys()] == [o.keys for o in live if o.keys]
            starts = [o.flight.start for o in pending if o.flight.start is not None]
            assert c.oldest_pending_start() == (min(starts) if starts else None)
            # unproduced_tokens: of the live flights' outputs; the decoding ones' at most produced
            assert c.output_tokens == sum(o.flight.output for o in live)
            left = c.unproduced_tokens(run.now)
            assert 0 <= left <= c.output_tokens
            decoding = [o.flight.output for o in live if id(o.flight) in run.decoding]
            assert left >= c.output_tokens - sum(decoding)  # a flight without a first byte: none
            assert c._decoding == len(decoding)
            # room_schedule: the flights decoding and those awaiting their first byte (each with
            # an expected output), each freeing its tokens less its cached blocks another holds
            plan = c.room_schedule(run.now)
            ahead = [o for o in live if o.prefill_open and o.flight.output > 0]
            running = [o for o in live if o.flight._first_at is not None]  # first byte at a time
            assert [kv for _out, kv, _u in plan.waiting] == [_frees(o, refs) for o in ahead]
            assert sorted(kv for *_, kv in plan.running) == sorted(_frees(o, refs) for o in running)
        for o in run.flights:
            o.flight.end()
            o.flight.end(run.now)
        c = run.counters
        assert (c.requests, c.tokens, c.pending_prefill_tokens, c.shared_tokens) == (0, 0, 0, 0)
        assert c.pending_prefill_pairs == 0.0 and c.oldest_pending_start() is None
        assert not c.held_keys() and not c.prompt_keys()
        assert (c.output_tokens, c.unproduced_tokens(run.now)) == (0, 0)
        assert c.room_schedule(run.now) == RoomSchedule(c.s_per_output_token * 1000.0)


def _frees(o: _Open, refs: Counter[int]) -> int:
    return int(o.flight.tokens - BS * sum(refs[k] > 1 for k in o.cached))


# ---------------------------------------------------------------------- placement.py
def test_the_evicted_shortcut_bound_covers_the_kv_in_use() -> None:
    """placement.IndexView.evicted: the shortcut's bound, ``max(queued, in_flight_tokens -
    shared_tokens)``, is "at most their tokens with each cached block once ... at least the queue
    ahead" of the KV in use (``max(queued, distinct prompt blocks)``), so the shortcut gives what
    the full formula gives. Candidates are built from real flight counters (as SimGateway and the
    Fleet do), other routers' load added on top; ``_shared_run`` is at most its limit."""
    index = index_of(("r",))
    for seed in range(15):
        for run, rng, tree in _random_flights(seed, 60):
            c = run.counters
            other_tokens, other_queue = rng.choice([0, 0, 200]), rng.choice([0, 0, 100])
            load = ReplicaLoad(c.requests, c.tokens + other_tokens, c.pending_prefill_tokens + other_queue)
            cand = Candidate("r", True, load, 0.0, c.shared_tokens, 0.0, c.prompt_keys())
            keys = tree.path(rng.choice(tree.keys))
            matched = rng.randint(0, len(keys))
            view = IndexView({"r": matched}, {"r": float(matched)}, index, keys, BS)
            prompts = [p for p in cand.flight_prompts if len(p)]
            in_use = max(load.pending_prefill_tokens, len(set().union(*prompts)) * BS)
            bound = max(load.pending_prefill_tokens, load.in_flight_tokens - cand.in_flight_shared_tokens)
            assert in_use <= bound
            runs = [placement._shared_run(keys, p, matched) for p in prompts]
            assert all(0 <= n <= matched for n in runs)
            pinned = max(runs, default=0)
            for capacity in (0, 200, 800, 3000):
                full = (
                    evicted_before_prefill(
                        matched, pinned, (load.pending_prefill_tokens, in_use, capacity), BS
                    )
                    if matched and load.pending_prefill_tokens and capacity > 0
                    else 0
                )
                assert view.evicted(cand, capacity) == full


_SYNC_MODULES = [
    "router_policies/placement.py",
    "router_policies/flights.py",
    "router_policies/ttft_feed.py",
    "router_policies/prefix_index.py",
    "router_policies/approx_lru.py",
    "router_policies/ttft/freshness.py",
    "router_policies/sim/sim_gateway.py",
]


@pytest.mark.parametrize("module", _SYNC_MODULES)
def test_the_glue_is_synchronous_and_reads_no_clock(module: str) -> None:
    """placement.py, flights.py and ttft_feed.py, "Invariants": everything is synchronous and
    times are passed in, never read (prefix_index.py: "Mutations never await", "Times are passed
    in by the caller"; freshness.py: "Time is the feed's own"; the simulator runs them on
    virtual time): no coroutine, no await, no clock module imported."""
    tree = ast.parse((REPO / module).read_text())
    clocks = {"time", "datetime", "asyncio", "trio", "anyio"}
    for node in ast.walk(tree):
        assert not isinstance(node, ast.AsyncFunctionDef | ast.Await | ast.AsyncFor | ast.AsyncWith), (
            module,
            node.lineno,
        )
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & clocks, (module, node.lineno)
        if isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] not in clocks, (module, node.lineno)


# ---------------------------------------------------------------------- ttft_feed.py
def test_which_first_tokens_are_fitted_is_decided_at_dispatch() -> None:
    """ttft_feed.py, "Invariants": which first tokens are fitted is decided at dispatch, before any
    is observed, so the fitted ones do not depend on their TTFT. Two feeds see the same dispatches
    and first bytes interleaved, with unrelated TTFTs: the same flights are fitted, exactly those
    a budget replayed on the dispatches alone takes, and each model fits exactly those."""
    for seed in range(5):
        rng = random.Random(seed)
        plan: list[tuple[str, float]] = []
        t = 0.0
        for _ in range(150):
            t += rng.choice([0.0, 0.0, 0.001, 0.01, 0.5])
            plan.append((rng.choice(["a", "b"]), t))
        fits: list[list[bool]] = []
        for ttft_scale in (0.01, 5.0):
            feed = TtftFeed(budget=ttft_feed.FitBudget(rate_per_s=20.0, burst=5.0))
            ttft_rng = random.Random(seed * 7 + int(ttft_scale * 100))
            waiting: list[tuple[float, Flight]] = []
            flags: list[bool] = []
            for replica, start in plan:
                while waiting and waiting[0][0] <= start:  # first bytes due before this dispatch
                    at, f = waiting.pop(0)
                    f.first_byte(at)
                f = feed.flight(
                    FlightCounters(), Dispatch(ReplicaState(replica), 500, 0, BS, 10), start=start
                )
                assert f.probe is not None
                flags.append(f.probe.fit)
                waiting.append((start + ttft_rng.random() * ttft_scale, f))
                waiting.sort(key=lambda w: w[0])
            for at, f in waiting:
                f.first_byte(at)
            for replica in ("a", "b"):
                fitted = sum(fl for fl, (r, _) in zip(flags, plan, strict=True) if r == replica)
                assert feed.model.params(replica).observations == fitted
            fits.append(flags)
        replay = ttft_feed.FitBudget(rate_per_s=20.0, burst=5.0)
        assert fits[0] == fits[1] == [replay.take(r, s) for r, s in plan]
        assert not all(fits[0])  # the budget did refuse some


def test_the_typical_fresh_fit_is_recomputed_at_most_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """ttft_feed.TtftFeed._typical_fresh: "recomputed at most once a second of the feed's time"."""
    feed = TtftFeed()
    at: list[float] = []
    real = ttft_feed._typical

    def counting(models: Sequence[TtftParams]) -> TtftParams | None:
        at.append(feed.freshness.latest)
        return real(models)

    monkeypatch.setattr(ttft_feed, "_typical", counting)
    state = ReplicaState("r")
    t = 0.0
    for i in range(200):
        t += 0.05
        replica = ("a", "b")[i % 2]
        f = feed.flight(FlightCounters(), Dispatch(ReplicaState(replica), 800, 0, BS, 5), start=t)
        f.first_byte(t + 0.02)
        feed.params("c")  # unseen: priced as its fresh peers at every decision
        feed.flight(FlightCounters(), Dispatch(state, 800, 0, BS, 5), start=t)
    assert len(at) >= 5
    assert all(b - a > 1.0 for a, b in itertools.pairwise(at)), at


def test_a_samples_relative_error_is_positive_when_the_model_expected_it_later() -> None:
    """ttft_feed.TtftSample.relative_error: "> 0 when the model expected it later"."""
    rng = random.Random(0)
    for _ in range(500):
        predicted, observed = rng.choice([0.0, 0.5, 3.0, 900.0]) * rng.random(), rng.random() * 50
        err = ttft_feed.TtftSample("r", predicted, observed).relative_error
        assert (err > 0) == (predicted > observed) and (err < 0) == (predicted < observed)


def test_a_fit_beyond_max_error_ratio_gives_way_to_a_prior_that_predicts_better() -> None:
    """ttft_feed.py, MAX_ERROR_RATIO and ``TtftFeed.params``: the policy routes on a replica's
    fit unless its robust relative error scale exceeds MAX_ERROR_RATIO and the prior's error on
    the same first tokens is smaller; then on the prior. (The comment once said such a fit is
    never routed on; ``test_ttft_feed.test_a_noisy_fit_is_still_routed_on_when_the_prior_predicts_
    worse`` relies on the comparison.) First tokens at the prior's speed or 4x faster, with
    multiplicative noise from mild to heavy: both answers occur."""
    answers = set()
    for seed in range(3):
        for speedup in (1.0, 4.0):
            for sigma in (0.3, 0.9, 1.5):
                rng = np.random.default_rng(seed)
                feed = TtftFeed()
                for _ in range(300):
                    state = ReplicaState("r", pending_prefill_tokens=int(rng.integers(0, 20_000)))
                    d = Dispatch(state, int(rng.integers(100, 4000)), 0, BS, 50)
                    f = feed.flight(FlightCounters(), d, start=0.0)
                    assert f.probe is not None
                    truth = predict(DEFAULT_PRIOR, f.probe.inputs).total_ms / speedup
                    f.first_byte(truth * float(np.exp(rng.normal(0, sigma))) / 1000.0)
                fitted = feed.model.params("r")
                prior_better = feed.model.prior_error("r") < fitted.error_ratio
                expect_prior = fitted.error_ratio > placement.MAX_ERROR_RATIO and prior_better
                chosen = feed.params("r")
                assert chosen is (feed.model.prior("r") if expect_prior else fitted) or (
                    expect_prior and chosen == feed.model.prior("r")
                )
                answers.add(expect_prior)
    assert answers == {True, False}


# ---------------------------------------------------------------------- ttft/freshness.py
def test_freshness_keeps_observation_order_and_probation_within_its_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ttft/freshness.py: ``_last`` "stays in observation order" (so the least recently observed
    goes first beyond MAX_REPLICAS), "a key of ``_probation`` is a key of ``_last``", a
    probation lasts PROBATION first tokens, and ``latest`` is the latest first byte observed."""
    monkeypatch.setattr(freshness, "MAX_REPLICAS", 4)
    for seed in range(30):
        rng = random.Random(seed)
        f = Freshness(stale_s=2.0)
        order: OrderedDict[str, float] = OrderedDict()
        probation: dict[str, int] = {}
        latest = -math.inf
        for _ in range(100):
            r = f"r{rng.randrange(7)}"
            now = rng.random() * 30
            start = rng.random() < 0.15
            f.observed(r, now, start)
            if start:
                probation[r] = freshness.PROBATION
            elif r in probation:
                probation[r] -= 1
                if not probation[r]:
                    del probation[r]
            order.pop(r, None)
            order[r] = now
            if len(order) > 4:
                gone, _ = order.popitem(last=False)
                probation.pop(gone, None)
            latest = max(latest, now)
            assert list(f.replicas()) == list(order)
            assert set(probation) <= set(order)
            assert {n: f.as_peers(n) for n in order} == {
                n: n in probation or latest - order[n] > 2.0 for n in order
            }
            assert f.latest == latest


# ---------------------------------------------------------------------- sim/sim_gateway.py
def test_the_sim_gateway_is_the_only_owner_of_the_index_replica_set() -> None:
    """sim/sim_gateway.py, "Invariant": the simulated fleet adds every replica once, at
    construction, and nothing it does changes the index's replica set."""
    names = ["r0", "r1", "r2"]
    for seed in range(3):
        rng = random.Random(seed)
        tree = ChainTree(rng, 30)
        index = PrefixIndex(IndexConfig(approximate_blocks_per_replica=8))
        gw = SimGateway(names, build_policy("kv_aware", {}, seed=seed), index, lambda _: (0, 0, 0.0))
        assert index.replicas == names
        flights: list[Flight] = []
        now = 0.0
        for _ in range(60):
            now += rng.choice([0.1, 1.0, 15.0])
            keys = tree.path(rng.choice(tree.keys))
            op = rng.random()
            if op < 0.5:
                routed = gw.route(RequestFeatures("m", keys, len(keys) * BS + 3, BS), 10, now)
                flights.append(routed.flight)
            elif op < 0.65:
                gw.stored(rng.choice(names), keys, now)
            elif op < 0.75:
                gw.removed(rng.choice(names), keys, now)
            elif op < 0.8:
                gw.cleared(rng.choice(names), now)
            elif flights:
                f = flights.pop(rng.randrange(len(flights)))
                f.first_byte(now)
                f.end()
            else:
                gw.advance(now)
            assert index.replicas == names
