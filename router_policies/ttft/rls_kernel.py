"""The compiled step of ``RobustRls.update`` (estimator.py states the method and its safeguards).

One first byte costs one update; with numpy on the coefficient vectors it cost ~100 us of interpreter and
array-call overhead on the request path (py-spy, docs/performance.md), the same arithmetic
compiled is a few microseconds. Same float64 operations in the same order as the numpy
formulation (tests/unit/test_rls_kernel.py compares the two on random sequences), in place on the
estimator's arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
F = TypeVar("F", bound=Callable[..., Any])


def _compiled(fn: F) -> F:
    return cast(F, numba.njit(cache=True, nogil=True)(fn))


@_compiled
def rls_step(w: F64, p: F64, z: F64, target: float, consts: F64) -> float:
    """One robust RLS step, in place on ``w`` (multiples) and ``p`` (covariance); ``z`` is the
    normalised feature vector and ``target`` the normalised observation; ``consts``: (clip,
    forgetting, max_w, p0_trace), ``clip`` bounding the residual that moves ``w``. Returns the
    residual before the update (unclipped)."""
    clip, forgetting, max_w, p0_trace = consts[0], consts[1], consts[2], consts[3]
    d = w.shape[0]
    pred = 0.0
    for i in range(d):
        pred += z[i] * w[i]
    e = target - pred
    clipped = min(max(e, -clip), clip)
    pz = np.empty(d)
    zpz = 0.0
    for i in range(d):
        s = 0.0
        for j in range(d):
            s += p[i, j] * z[j]
        pz[i] = s
        zpz += z[i] * s
    denom = forgetting + zpz
    for i in range(d):
        v = w[i] + pz[i] / denom * clipped
        w[i] = min(max(v, 0.0), max_w)
    tr = 0.0
    for i in range(d):
        gi = pz[i] / denom
        for j in range(d):
            p[i, j] = (p[i, j] - gi * pz[j]) / forgetting
    for i in range(d):
        for j in range(i + 1, d):
            m = (p[i, j] + p[j, i]) / 2
            p[i, j] = m
            p[j, i] = m
        tr += p[i, i]
    if tr > p0_trace:
        f = p0_trace / tr
        for i in range(d):
            for j in range(d):
                p[i, j] *= f
    return e


@_compiled
def dot_scaled(x: F64, ref: F64, w: F64) -> float:
    """sum(x * ref * w): a prediction in ms from raw features."""
    s = 0.0
    for i in range(x.shape[0]):
        s += x[i] * ref[i] * w[i]
    return s
