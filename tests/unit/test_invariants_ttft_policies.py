"""The invariants and formulas stated in router_policies' TTFT model (ttft/*.py), its policies
(policies/*.py, policy.py) and flags.py, each checked over seeded random sequences (the house rule:
an invariant a comment states holds because a test or an assert says so). A claim found false is
kept as ``xfail(strict=True)`` with the reason."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from router_policies.flags import options_from_flags
from router_policies.policies.consistent_hash import ConsistentHash, ConsistentHashParams
from router_policies.policies.kv_aware import REFS_PER_REPLICA, KvAware
from router_policies.policies.kv_aware_params import KvAwareParams
from router_policies.policies.kv_speed import speed_groups, speed_size
from router_policies.policy import FleetSnapshot, ReplicaState, RequestFeatures, load_of
from router_policies.ttft import estimator as est
from router_policies.ttft.features import REFERENCE_INPUTS, TtftInputs, feature_vector, predict, split_cached
from router_policies.ttft.model import TtftModel
from router_policies.ttft.params import COEFFICIENTS, DEFAULT_PRIOR, NAMED_PRIORS
from router_policies.ttft.snapshot import inputs_for
from tests.unit.test_invariants_placement import test_the_glue_is_synchronous_and_reads_no_clock as _sync
from tests.unit.test_kv_aware_speed import scaled
from tests.unit.test_rls_kernel import step_reference

REPO = Path(__file__).resolve().parents[2]
CFG = est.FitConfig()


def _inputs(rng: random.Random) -> TtftInputs:
    kv, queued = rng.randrange(0, 500_000), rng.choice((0, rng.randrange(1, 30_000)))
    return TtftInputs(
        queued, rng.randrange(0, 300), kv, rng.randrange(0, 16_000), rng.randrange(0, 30_000),
        rng.choice((0.0, rng.uniform(0, 50))), rng.uniform(0, 1e9) if queued else 0.0,
        rng.randrange(0, kv + 1), rng.uniform(0, 500) if queued else 0.0,
    )  # fmt: skip


def _replica(rng: random.Random, name: str, blocks: int) -> ReplicaState:
    """A replica of random load, match (some of it evicted, some on disk), fill and fit."""
    m = rng.randrange(blocks + 1)
    return ReplicaState(
        name, in_flight_requests=rng.randrange(40), in_flight_tokens=rng.randrange(200_000),
        pending_prefill_tokens=rng.randrange(20_000), engine_running=rng.randrange(20),
        engine_waiting=rng.randrange(40), matched_blocks=m, evicted_blocks=rng.randrange(m + 1),
        held_blocks=rng.choice((0, rng.randrange(1000))), matched_on_media=(("DISK", rng.randrange(m + 1)),),
        pending_prefill_pairs=rng.uniform(0, 1e8), in_flight_shared_tokens=rng.randrange(5000),
        pending_age_ms=rng.uniform(0, 300), ttft=rng.choice((None, scaled(rng.uniform(0.5, 4)))),
    )  # fmt: skip


def _req(keys: list[int], prompt: int, bs: int = 16) -> RequestFeatures:
    return RequestFeatures("m", keys, prompt, bs)


def _imports(module: str) -> set[str]:
    tree = ast.parse((REPO / module).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}


def test_residuals_the_robust_scale_and_the_prior_covariance_follow_their_formulas() -> None:
    """estimator.py: the residual is (y - p) / sqrt(p y), each at least ``min_norm_ms``, symmetric;
    the scale is an EW mean of 1.25 x |residual| clipped to huber_k x s, never below ``min_scale``,
    growing by at most 1 + scale_rate (huber_k x 1.25 - 1) per observation."""
    rng = random.Random(1)
    growth = 1 + CFG.scale_rate * (CFG.huber_k * 1.25 - 1)
    s = CFG.initial_scale
    for _ in range(2000):
        p, y = rng.choice((0.5, rng.uniform(0, 1e5))), rng.choice((0.3, rng.uniform(0, 1e5)))
        pp, yy = max(p, CFG.min_norm_ms), max(y, CFG.min_norm_ms)
        assert est.residual_norm(p, y, CFG) == pytest.approx(math.sqrt(pp * yy), rel=1e-12)
        r = est.relative_residual(p, y, CFG)
        assert r == pytest.approx((y - pp) / math.sqrt(pp * yy), rel=1e-12, abs=1e-12)
        if min(p, y) >= CFG.min_norm_ms:
            assert est.relative_residual(y, p, CFG) == pytest.approx(-r, rel=1e-12, abs=1e-12)
        new = est.next_scale(s, r, CFG)
        want = (1 - CFG.scale_rate) * s + CFG.scale_rate * 1.25 * min(abs(r), CFG.huber_k * s)
        assert new == pytest.approx(max(CFG.min_scale, want), rel=1e-12)
        assert CFG.min_scale <= new <= s * growth * (1 + 1e-12)
        s = new
    for _ in range(1000):  # exact predictions: the scale decays to its floor, never below
        s = est.next_scale(s, 0.0, CFG)
    assert s == CFG.min_scale
    # P0 = I / prior_strength + speed_variance x v v^T / |v|^2, v: the prior's but queue_age_ratio
    for _ in range(50):
        w0 = np.asarray([rng.uniform(0, 5) for _ in COEFFICIENTS])
        v = np.where(np.arange(len(w0)) == COEFFICIENTS.index("queue_age_ratio"), 0.0, w0)
        want = np.eye(len(w0)) / CFG.prior_strength + CFG.speed_variance * np.outer(v, v) / (v @ v)
        np.testing.assert_allclose(est.prior_covariance(w0, CFG), want, rtol=1e-12)


def test_each_fit_step_is_the_documented_robust_step() -> None:
    """estimator.py: each step clips at huber_k x s, forgets, keeps coefficients in [0, max_multiple x
    reference] and tr P within tr P0; ``update`` returns the residual before it; ``PriorScale`` is the
    same scale; P is reset to P0 when the fast scale exceeds reset_ratio x the slow one (10x slower)."""
    rng = random.Random(3)
    fit, prior_scale = est.RobustRls(DEFAULT_PRIOR.coefficients(), CFG), est.PriorScale(CFG)
    truth = np.asarray(DEFAULT_PRIOR.coefficients()) * np.array([1.5, 0.7, 3, 1, 1, 1, 1, 0, 1])
    ref = np.maximum(np.asarray(DEFAULT_PRIOR.coefficients()), est.REFERENCE_FLOORS)
    p0_trace = float(np.trace(fit._p0))
    capped = False
    for i in range(1100):  # a noisy fit; 6x slower (resets); lone prompts (trace cap); absurd (bounds)
        x = feature_vector(_inputs(rng) if i < 400 else TtftInputs(0, 0, 0, rng.randrange(1, 8000), 0), DEFAULT_PRIOR)  # fmt: skip
        noise = math.exp(rng.gauss(0, 0.05)) * rng.choice((1, 1, 1, 1, 12)) if i < 400 else 1.0
        y = float(np.dot(x, truth)) * (1.0 if i < 250 else 6.0) * noise if i < 900 else 1e9
        w, p, s, slow, resets = fit._w.copy(), fit._p.copy(), fit.scale, fit._slow_scale, fit.resets
        pred = fit.predict(x)
        norm = est.residual_norm(max(pred, CFG.min_norm_ms), y, CFG)
        consts = (CFG.huber_k * s, CFG.forgetting, CFG.max_multiple, p0_trace)
        wr, pr, er = step_reference(w, p, np.asarray(x) * ref / norm, y / norm, consts)
        got = fit.update(x, y)
        prior_scale.update(pred, y)
        assert got == pytest.approx(er, rel=1e-9, abs=1e-12)
        assert got == pytest.approx(est.relative_residual(pred, y, CFG), rel=1e-9, abs=1e-12)
        assert prior_scale.scale == pytest.approx(fit.scale, rel=1e-9)
        np.testing.assert_allclose(fit._w, wr, rtol=1e-9, atol=1e-12)
        s_new = est.next_scale(s, er, CFG)
        slow_new = est.next_scale(slow, er, CFG, CFG.scale_rate / 10, consts[0])
        assert fit.scale == pytest.approx(s_new, rel=1e-9)
        if s_new > CFG.reset_ratio * slow_new:
            assert fit.resets == resets + 1 and np.array_equal(fit._p, fit._p0)
            assert fit._slow_scale == fit.scale
        else:
            assert fit.resets == resets and fit._slow_scale == pytest.approx(slow_new, rel=1e-9)
            np.testing.assert_allclose(fit._p, pr, rtol=1e-9, atol=1e-9)
        assert np.trace(fit._p) <= p0_trace * (1 + 1e-12)
        capped |= fit.resets == resets and np.trace(fit._p) > p0_trace * (1 - 1e-9)
        assert all(0 <= c <= CFG.max_multiple * r for c, r in zip(fit.coefficients(), ref, strict=True))
    assert fit.resets > 0 and capped and max(fit._w) == CFG.max_multiple and fit.observations == 1100


def test_eleven_consecutive_clipped_residuals_reset_the_covariance() -> None:
    """estimator.py: eleven consecutive clipped residuals reset the covariance at the defaults,
    from equal scales (found false as "about nine": that counts the fast scale alone)."""
    fit = est.RobustRls(DEFAULT_PRIOR.coefficients(), CFG)  # fast and slow scales start equal
    x = feature_vector(TtftInputs(0, 0, 0, 1000, 0), DEFAULT_PRIOR)
    steps = 0
    while not fit.resets:
        fit.update(x, 1e4 * fit.predict(x))  # every residual clipped
        steps += 1
    assert steps == 11, steps


def test_the_prediction_is_the_documented_formula() -> None:
    """features.py: TTFT = steps(Q + u) x (step + n decode + K kv_read / 1e6) + (Q + u) prefill +
    (A + u (c + (u + 1) / 2)) / 1e6 attention + c cached + X kv_wait + overhead + H queue_age, X =
    max(0, K - S + u + c - capacity) / 1e3, every term x calibration, plus fetch; wait_ms is the
    same for the work ahead alone (0 steps when Q = 0), read_ms the cached term, prefill_ms the
    rest; added = u prefill + u (c + (u + 1) / 2) / 1e6 attention + u / (B - n) x per step."""
    rng = random.Random(4)
    for _ in range(500):
        chunk = rng.choice((512, 2048, 8192))
        coefs = tuple(rng.uniform(0, 3) for _ in COEFFICIENTS)
        p = dataclasses.replace(
            DEFAULT_PRIOR.with_coefficients(coefs, 0, 0.0, rng.uniform(0.3, 3)), chunk_tokens=chunk,
            max_num_seqs=rng.choice((8, 64, 256, chunk - 1)), kv_capacity_tokens=rng.choice((20_000, 400_000)),
        )  # fmt: skip
        x = _inputs(rng)
        c0, c1, c2, c3, c4, c5, c6, c7, c8 = coefs
        q, u, c, kv, a = x.queued_prefill_tokens, x.uncached_tokens, x.cached_tokens, x.kv_tokens, x.queued_prefill_pairs  # fmt: skip
        n = min(x.decoding, p.max_num_seqs)
        per_step = c0 + n * c3 + kv * c4 / 1e6
        steps_own, steps_ahead = max(1, -(-(q + u) // (chunk - n))), -(-q // (chunk - n))
        room = kv - x.shared_kv_tokens - p.kv_capacity_tokens
        x_own, x_ahead = max(0, room + u + c) / 1e3, max(0, room) / 1e3
        pairs = u * (c + (u + 1) / 2)
        total = steps_own * per_step + (q + u) * c1 + (a + pairs) / 1e6 * c2 + c * c5 + x_own * c6 + c7 + x.pending_age_ms * c8  # fmt: skip
        wait = steps_ahead * per_step + q * c1 + a / 1e6 * c2 + x_ahead * c6 + x.pending_age_ms * c8
        added = u * c1 + pairs / 1e6 * c2 + u / (chunk - n) * per_step
        k, pred = p.calibration, predict(p, x)
        got = (pred.total_ms, pred.wait_ms, pred.read_ms, pred.prefill_ms, pred.added_ms, pred.fetch_ms)
        want = (k * total + x.fetch_ms, k * wait, k * c * c5, k * (total - wait - c * c5), k * added, x.fetch_ms)  # fmt: skip
        assert got == pytest.approx(want, rel=1e-9, abs=1e-6)


def test_each_medium_costs_the_cheaper_of_its_fetch_and_its_recompute() -> None:
    """features.split_cached / params.py: a medium's matched tokens are fetched when that costs
    less than computing them, else priced as uncached; an unknown medium costs nothing; the
    tokens beyond the match are uncached (NVMe against H100 prefill: fetching wins beyond ~70)."""
    rng = random.Random(5)
    media = ("CPU", "disk", "REMOTE", "GPU", "tape")
    for _ in range(500):
        p = dataclasses.replace(DEFAULT_PRIOR, prefill_ms_per_token=rng.uniform(0.001, 0.2))
        prompt, matched = rng.randrange(0, 20_000), rng.randrange(-5, 25_000)
        on = [(rng.choice(media), rng.randrange(-10, 4000)) for _ in range(rng.randrange(4))]
        unc, cached, fetch = split_cached(p, prompt, matched, on)
        m = max(0, min(matched, prompt))
        assert unc + cached == prompt and 0 <= cached <= m and unc >= prompt - m
        left, cheapest = m, 0.0
        for medium, tokens in on:
            t, tier = min(max(0, tokens), left), p.tier(medium)
            if t and tier is not None:
                left -= t
                cheapest += min(tier.fetch_ms(t, p.kv_bytes_per_token), t * p.prefill_ms_per_token)
        recomputed = unc - (prompt - m)
        assert fetch + recomputed * p.prefill_ms_per_token == pytest.approx(cheapest, rel=1e-9, abs=1e-9)
    assert split_cached(DEFAULT_PRIOR, 1000, 1000, [("DISK", 69)])[0] == 69  # recomputed
    assert split_cached(DEFAULT_PRIOR, 1000, 1000, [("DISK", 70)])[0] == 0  # fetched


def test_a_fitted_copy_refuses_what_the_constructor_refuses() -> None:
    """params.py: ``with_coefficients`` repeats the checks that could fail on fitted values, so it
    refuses exactly what ``dataclasses.replace`` refuses, and otherwise makes the same params."""
    rng = random.Random(10)
    for _ in range(300):
        values = tuple(rng.choice((0.0, 1.5, 1.5, -1e-9)) for _ in COEFFICIENTS)
        obs, err, cal = rng.choice((0, 3, -1)), rng.choice((0.0, 0.2, -0.1)), rng.choice((1.0, 2.0, 0.0, -2.0))  # fmt: skip
        changes: dict[str, Any] = {**dict(zip(COEFFICIENTS, values, strict=True)), "observations": obs, "error_ratio": err, "calibration": cal}  # fmt: skip
        try:
            want = dataclasses.replace(DEFAULT_PRIOR, **changes)
        except ValueError:
            with pytest.raises(ValueError):
                DEFAULT_PRIOR.with_coefficients(values, obs, err, cal)
            continue
        assert DEFAULT_PRIOR.with_coefficients(values, obs, err, cal) == want


def test_the_model_keeps_the_most_recently_observed_fits_and_refuses_impossible_times() -> None:
    """model.py: at most ``max_replicas`` fits, the least recently observed dropped (back to its
    prior); impossible observations change nothing; ``set_prior`` restarts a fit; between
    observations ``params`` is one value; the tiers' fetch is known, not fitted."""
    rng = random.Random(6)
    m, twin = TtftModel(max_replicas=3), TtftModel(max_replicas=3)
    lru: OrderedDict[str, None] = OrderedDict()  # the model: fitted replicas, least recent first
    names = [f"r{i}" for i in range(6)]
    for _ in range(400):
        r, op = rng.choice(names), rng.random()
        x = dataclasses.replace(_inputs(rng), fetch_ms=rng.choice((0.0, 2.5, 17.25)))  # exact y + f - f
        before = m.params(r)
        if op < 0.1:
            assert not m.observe_first_token(r, x, rng.choice((math.nan, math.inf, -math.inf, -1.0)))
            assert m.params(r) is before
        elif op < 0.2:
            prior = scaled(rng.uniform(0.5, 3))
            for model in (m, twin):
                model.set_prior(r, prior)
            lru.pop(r, None)
            assert m.params(r) is prior
        else:
            y = float(rng.randrange(1, 5000))
            assert m.observe_first_token(r, x, y + x.fetch_ms)
            assert twin.observe_first_token(r, dataclasses.replace(x, fetch_ms=0.0), y)
            assert m.params(r) == twin.params(r)
            lru[r] = None
            lru.move_to_end(r)
            while len(lru) > 3:
                lru.popitem(last=False)
        assert len(m) == len(lru)
        for name in names:
            assert m.params(name) is m.params(name)
            assert (name in lru) == (m.params(name) is not m.prior(name)), name
            assert name in lru or m.prior_error(name) == CFG.initial_scale


def test_inputs_for_reads_the_snapshot_as_documented() -> None:
    """snapshot.py: each ``TtftInputs`` field is the ``ReplicaState`` figure its docstring names;
    decoding is ``load_of``; the matched blocks on slower media are priced by ``split_cached``."""
    rng = random.Random(7)
    for _ in range(300):
        s, prompt, bs = _replica(rng, "r", 100), rng.randrange(1, 8000), rng.choice((16, 64))
        got = inputs_for(s, prompt, s.matched_blocks * bs, bs, DEFAULT_PRIOR)
        media = [(medium, blocks * bs) for medium, blocks in s.matched_on_media]
        unc, cached, fetch = split_cached(DEFAULT_PRIOR, prompt, s.matched_blocks * bs, media)
        want = (s.pending_prefill_tokens, load_of(s), s.in_flight_tokens, unc, cached, fetch, s.pending_prefill_pairs, s.in_flight_shared_tokens, s.pending_age_ms)  # fmt: skip
        assert got == TtftInputs(*want)


def test_consistent_hash_keys_on_one_block_bounds_the_load_and_memoises_only_a_cache() -> None:
    """consistent_hash.py: the key is block prefix_blocks - 1's (or a shorter prompt's last); the
    replica taking a request stays within ceil(load_factor (total + 1) / n), never all full; the
    ring memoised per replica set is a cache: the policy decides as a fresh one."""
    rng = random.Random(8)
    params = ConsistentHashParams(prefix_blocks=2, load_factor=1.25, virtual_nodes=40)
    policy = ConsistentHash(params)
    for _ in range(400):
        ids = rng.sample([f"r{i}" for i in range(8)], rng.randint(1, 6))
        fleet = FleetSnapshot(tuple(ReplicaState(i, in_flight_requests=rng.randrange(10)) for i in ids))
        keys = [rng.getrandbits(64) for _ in range(rng.randint(1, 4))]
        d = policy.choose(_req(keys, 16 * len(keys)), fleet)
        assert d == ConsistentHash(params).choose(_req(keys, 16 * len(keys)), fleet)
        at = min(params.prefix_blocks, len(keys)) - 1
        other = [k if j == at else rng.getrandbits(64) for j, k in enumerate(keys)]
        assert policy.choose(_req(other, 16 * len(keys) + 5), fleet).replica == d.replica
        total = sum(load_of(r) for r in fleet.replicas)
        chosen = next(r for r in fleet.replicas if r.id == d.replica)
        assert load_of(chosen) + 1 <= math.ceil(params.load_factor * (total + 1) / len(ids))
        assert d.reason != "consistent_hash:all_full"


def test_no_replica_exceeds_load_factor_times_the_mean_rounded_up() -> None:
    """consistent_hash.py: no replica exceeds load_factor times the mean, rounded up to a whole
    request (found false without the rounding: one request on an idle fleet of 4)."""
    fleet = FleetSnapshot(tuple(ReplicaState(f"r{i}") for i in range(4)))
    d = ConsistentHash(ConsistentHashParams()).choose(_req([1, 2], 32), fleet)
    loads = {r.id: load_of(r) + (r.id == d.replica) for r in fleet.replicas}  # after the request
    assert max(loads.values()) <= math.ceil(1.25 * sum(loads.values()) / len(loads))


def _want_costs(p: KvAwareParams, req: RequestFeatures, healthy: list[ReplicaState]) -> tuple[list[float], bool]:  # fmt: skip
    """cost_r by kv_aware's docstring, written out from its definitions; and whether matched_r is 0 everywhere."""
    prior, prompt = NAMED_PRIORS[p.prior], req.prompt_tokens
    mw = p.miss_weight or (7.0 if p.rule == "ms" else 4.0)
    matched = [min((r.matched_blocks - r.evicted_blocks) * req.block_size, prompt) for r in healthy]
    matched = [m if m >= p.min_match_ratio * prompt else 0 for m in matched]
    most = max(r.held_blocks for r in healthy)
    fill = [r.held_blocks / most if most else 0.0 for r in healthy]
    w_fill = p.fill_weight if any(matched) else p.fill_weight / mw
    spread = [1 + w_fill * (f - min(fill)) for f in fill]
    own, loads = [r.ttft or prior for r in healthy], [load_of(r) for r in healthy]
    if p.rule == "tokens":
        at_size = dataclasses.replace(REFERENCE_INPUTS, uncached_tokens=speed_size(prompt))
        group = speed_groups([predict(m, at_size).total_ms for m in own], p.speed_ratio or math.inf)
        uncached = [(prompt - m) * s for m, s in zip(matched, spread, strict=True)]
        return [g / (sum(group) / len(group)) * (r.pending_prefill_tokens + p.request_cost_tokens * ld + u) + (mw - 1) * u
                for g, r, ld, u in zip(group, healthy, loads, uncached, strict=True)], not any(matched)  # fmt: skip
    refs = [predict(m, REFERENCE_INPUTS).total_ms for m in own]
    mid = sorted(range(len(own)), key=refs.__getitem__)[len(own) // 2]  # the upper median
    same = [p.same_speed > 0 and abs(x / refs[mid] - 1) <= p.same_speed for x in refs]
    model = [own[mid] if s else m for s, m in zip(same, own, strict=True)]
    refs = [refs[mid] if s else x for s, x in zip(same, refs, strict=True)]
    share = {"fleet": [sum(refs) / len(refs) / x for x in refs], "local": [1.0] * len(refs),
             "load": [(1 + ld) / (1 + sum(loads) / len(loads)) for ld in loads]}[p.behind]  # fmt: skip
    preds = [predict(mod, inputs_for(r, prompt, m, req.block_size, mod)) for r, m, mod in zip(healthy, matched, model, strict=True)]  # fmt: skip
    return [x.total_ms + (s * (1 + (mw - 1) * sh) - 1) * x.added_ms for x, s, sh in zip(preds, spread, share, strict=True)], not any(matched)  # fmt: skip


def test_kv_aware_scores_are_the_documented_costs_and_the_guard_holds() -> None:
    """kv_aware.py's docstring, both rules: matched_r, fill_r, w_fill, spread_r, model_r, share_r,
    time_r, cost_r; the cheapest replica within the guard (and room first) wins, never all excluded."""
    rng = random.Random(9)
    for _ in range(300):
        p = KvAwareParams(
            rule=rng.choice(("ms", "tokens")), prior=rng.choice(("llama3-8b-h100", "small-cpu")),
            min_match_ratio=rng.choice((0.0, 0.1, 0.5)), miss_weight=rng.choice((None, rng.uniform(1, 8))),
            behind=rng.choice(("fleet", "load", "local")), fill_weight=rng.choice((0.0, 0.5, 2.0)),
            speed_ratio=rng.choice((0.0, 2.0)), same_speed=rng.choice((0.0, 0.3)),
            balance_abs=rng.choice((0.0, 4.0, 32.0)), balance_rel=rng.choice((1.0, 1.5)),
        )  # fmt: skip
        bs, blocks = rng.choice((16, 64)), rng.randrange(1, 200)
        req = _req(list(range(blocks)), blocks * bs + rng.randrange(bs), bs)
        healthy = [_replica(rng, f"r{i}", blocks) for i in range(rng.randint(1, 5))]
        d = KvAware(p, seed=rng.randrange(5)).choose(req, FleetSnapshot((*healthy, ReplicaState("x", healthy=False))))  # fmt: skip
        want, cold = _want_costs(p, req, healthy)
        assert [d.scores[r.id] for r in healthy] == pytest.approx(want, rel=1e-9)
        loads = [load_of(r) for r in healthy]
        limit = p.balance_rel * sum(loads) / len(loads) + p.balance_abs
        assert d.reason != "kv_aware:all_hot" and loads[[r.id for r in healthy].index(d.replica)] <= limit
        ok = [ld <= limit for ld in loads]
        roomy = [o and r.in_flight_tokens - min(r.in_flight_shared_tokens, r.in_flight_tokens) + req.prompt_tokens <= (r.ttft or NAMED_PRIORS[p.prior]).kv_capacity_tokens for o, r in zip(ok, healthy, strict=True)]  # fmt: skip
        ok = roomy if cold and any(roomy) else ok  # room first (kv_stall.py): a prompt held nowhere
        assert d.scores[d.replica] == pytest.approx(min(c for c, o in zip(want, ok, strict=True) if o), rel=1e-9)  # fmt: skip


def test_the_reference_memory_holds_at_most_refs_per_replica_and_one_decisions() -> None:
    """kv_aware.py: REFS_PER_REPLICA per healthy replica, plus one decision's own after a clear
    (found false without the decision's: 9 per replica)."""
    policy, rng = KvAware(KvAwareParams()), random.Random(3)
    for _ in range(300):
        fleet = FleetSnapshot(tuple(ReplicaState(f"r{i}", ttft=scaled(rng.uniform(1, 5))) for i in range(3)))
        policy.choose(_req([1], 16), fleet)
        assert len(policy._refs) <= (REFS_PER_REPLICA + 1) * 3


_DECIDING = ["router_policies/policy.py", *(f"router_policies/policies/{m}.py" for m in ("kv_aware", "kv_speed", "consistent_hash", "least_loaded", "round_robin", "rotation")),
             *(f"router_policies/ttft/{m}.py" for m in ("features", "params", "model", "estimator", "rls_kernel", "snapshot"))]  # fmt: skip


@pytest.mark.parametrize("module", _DECIDING)
def test_deciding_never_awaits_nor_reads_a_clock(module: str) -> None:
    """policy.py: ``choose`` is a pure, synchronous function: it never awaits and never does I/O
    (no coroutine, no clock module in what it runs); estimator.py: deterministic, no randomness."""
    _sync(module)
    assert not {"random", "os", "socket", "urllib.request"} & _imports(module)
    tree = ast.parse((REPO / module).read_text())
    assert not any(isinstance(n, ast.Attribute) and n.attr == "random" for n in ast.walk(tree))


def test_flags_fill_every_field_or_fail() -> None:
    """flags.py: every init field not given comes from its flag (a missing one raises
    AttributeError: nothing filled silently), or those ``names`` lists; pure: argparse and dataclasses."""
    fields: list[Any] = [("block_size", int), ("model", str), ("rate", float, 1.0), ("derived", int, dataclasses.field(init=False, default=0))]  # fmt: skip
    Opts = dataclasses.make_dataclass("Opts", fields)
    args = argparse.Namespace(block_size=16, model="m", rate=2.5, unrelated=1)
    assert options_from_flags(Opts, args) == Opts(16, "m", 2.5)
    assert options_from_flags(Opts, args, model="given") == Opts(16, "given", 2.5)
    assert options_from_flags(Opts, args, ["block_size", "model"]) == Opts(16, "m")
    with pytest.raises(AttributeError):
        options_from_flags(Opts, argparse.Namespace(block_size=16, model="m"))
    assert _imports("router_policies/flags.py") <= {"__future__", "argparse", "dataclasses", "collections.abc", "typing"}  # fmt: skip
