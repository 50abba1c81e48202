"""The compiled RLS step does what its numpy formulation does (router_policies/ttft/rls_kernel.py)."""

from __future__ import annotations

import numpy as np

from router_policies.ttft.rls_kernel import F64, dot_scaled, rls_step


def step_reference(
    w: F64, p: F64, z: F64, target: float, consts: tuple[float, float, float, float]
) -> tuple[F64, F64, float]:
    """The numpy formulation ``rls_step`` compiles (for the equivalence test): returns (w, p, e)."""
    clip, forgetting, max_w, p0_trace = consts
    e = target - float(np.dot(z, w))
    clipped = min(max(e, -clip), clip)
    pz = p @ z
    gain = pz / (forgetting + float(z @ pz))
    w = np.clip(w + gain * clipped, 0.0, max_w)
    p = (p - np.outer(gain, pz)) / forgetting
    p = (p + p.T) / 2
    tr = float(np.trace(p))
    if tr > p0_trace:
        p = p * (p0_trace / tr)
    return w, p, e


def test_compiled_step_matches_the_numpy_reference_on_random_sequences() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        d = 7
        w = rng.uniform(0, 3, d)
        p = np.eye(d) * rng.uniform(1, 100)
        p0_trace = float(np.trace(p))
        wr, pr = w.copy(), p.copy()
        for _ in range(200):
            z = rng.uniform(0, 2, d) * (rng.uniform(0, 1, d) > 0.3)
            target = float(rng.normal(1.0, 0.5))
            consts = (float(rng.uniform(0.05, 1.0)), 0.995, 100.0, p0_trace)
            e = rls_step(w, p, z, target, np.array(consts))
            wr, pr, er = step_reference(wr, pr, z, target, consts)
            assert abs(e - er) <= 1e-9 * max(1.0, abs(er))
            np.testing.assert_allclose(w, wr, rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(p, pr, rtol=1e-9, atol=1e-9)
            assert np.trace(p) <= p0_trace * (1 + 1e-12)  # the trace cap holds
            assert (w >= 0).all() and (w <= 100).all()  # the multiples stay in bounds


def test_dot_scaled() -> None:
    x, ref, w = np.array([1.0, 2.0]), np.array([3.0, 0.5]), np.array([2.0, 4.0])
    assert dot_scaled(x, ref, w) == 1 * 3 * 2 + 2 * 0.5 * 4


def test_with_coefficients_equals_a_replace() -> None:
    import dataclasses

    from router_policies.ttft.params import COEFFICIENTS, DEFAULT_PRIOR

    values = tuple(float(i) + 0.5 for i in range(len(COEFFICIENTS)))
    fast = DEFAULT_PRIOR.with_coefficients(values, 3, 0.25)
    fitted: dict[str, object] = dict(zip(COEFFICIENTS, values, strict=True))
    slow = dataclasses.replace(DEFAULT_PRIOR, **fitted, observations=3, error_ratio=0.25)  # type: ignore[arg-type]
    assert fast == slow
