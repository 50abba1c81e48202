"""Robust online least squares with forgetting: the per-replica fit of the TTFT model
(docs/architecture.md, "Routing on predicted milliseconds").

Recursive least squares on relative errors, with three safeguards an online fit on live traffic
needs:

* Relative errors: each observation is divided by the geometric mean of the current prediction
  and the observation (each at least ``min_norm_ms``), so a 20 ms first token weighs as much as a
  20 s one; the residual (y - p) / sqrt(p y) is log(y / p) to second order, symmetric in over-
  and under-prediction, so the fit follows the mean of log(y / p), the median of a symmetric
  multiplicative noise, not its mean (noise skewed late still puts it above the median, which
  the model's per-replica ``Calibration`` corrects, router_policies/ttft/model.py).
  Why: first tokens on a shared host are skewed (a stalled event loop makes one 3x late, never
  3x early); divided by the prediction alone, the late ones pulled the fit up and it over-
  predicted the typical first token (the first tokens of a live Mooncake run of bench/live.py
  replayed through the fit: median relative error 0.40, 0.32 so; the TTFT audit reads the median).
* Outliers (Huber): a relative residual is clipped to ``huber_k`` x the robust scale ``s`` before
  it moves the estimate; ``s`` follows an exponentially weighted mean of the clipped absolute
  residuals (x 1.25, the normal mean-absolute-deviation factor). One stall or network hiccup moves
  the fit by at most ``huber_k s`` times its gain; a real change of speed makes every residual
  large, ``s`` (never below ``min_scale``) grows by at most a factor 1 + scale_rate (huber_k x 1.25 - 1) per observation, and
  the fit follows.
* Change detection (covariance resetting): forgetting alone needs about its memory in
  observations to follow a replica that became slower or faster (a neighbour on the same GPU,
  thermal throttling, a new engine version). When the fast scale ``s`` exceeds ``reset_ratio``
  times a slow one (the same residuals, averaged ten times more slowly), the residuals are
  persistently large, not a few outliers (clipping limits how fast ``s`` can grow: eleven
  consecutive clipped residuals at the defaults, from equal scales: the slow one grows too), and the covariance goes back to the prior's:
  the next observations re-fit the coefficients from where they are.
* Forgetting and windup: the covariance is divided by ``forgetting`` (< 1) at each step, so
  old observations weigh ``forgetting^age`` (memory about 1 / (1 - forgetting) observations); its
  trace is capped at the prior's, so directions the traffic does not excite (say, decode load on
  an idle replica) cannot blow up between observations.
* The prior's covariance says what the prior is least sure of: the replica's speed. A prior is a
  profile of one kind of hardware; a replica of another kind (or the default prior in front of
  an unknown engine) differs from it mostly by one factor on every engine-time coefficient,
  while how a first token's time splits among the terms (per step, per token, attention) is
  surer. So P0 = I / prior_strength + speed_variance x v v^T / |v|^2, v the prior's multiples
  along the coefficients that scale with the engine's speed (all but ``queue_age_ratio``, a
  ratio of waits). Why: with an isotropic P0 (I / 0.01) the first observations moved each
  coefficient in proportion to its share of them, and traffic of one prompt size cannot tell
  per-step from per-token costs apart, so the fit's reading of a replica's speed at another size
  drifted with the noise. Two replicas 2.84x apart fitted from the default prior on prompts of
  700-760 tokens (10 % noise, five seeds), read at 2,048 tokens: ratios 2.07-3.36 after 6 first
  tokens, 2.37-5.58 after 50; with this P0 2.43-2.81 and 2.46-2.93
  (tests/unit/test_ttft_model.py). Replayed, the first tokens of live bench runs gave the TTFT
  audit's median error 0.075 / 0.065 / 0.082 / 0.254 (agent, kv_pressure, hetero,
  decode_heavy) against 0.086 / 0.073 / 0.087 / 0.264, and 0.182 against 0.173 on Mooncake
  (docs/performance.md, "The prior's speed first").

Coefficients are fitted as multiples ``w`` of reference scales (the prior, or a floor where the
prior is 0), so that every direction is of order 1, and kept within ``[0, max_multiple]``.
Memory: d-vectors and two d x d matrices (the covariance and the prior's; d = 9), whatever the
number of observations.
Deterministic: float64 arithmetic only, no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from router_policies.ttft.params import COEFFICIENTS
from router_policies.ttft.rls_kernel import dot_scaled, rls_step

# Smallest reference scale per coefficient (see params.COEFFICIENTS), where a prior is 0: 1 ms
# per step; 0.01 ms per token, per decoding sequence; 0.1 ms per million attention pairs; 10 ms
# per million KV tokens read per step; 0.001 ms per cached token; 1 ms per thousand tokens of
# KV demand beyond capacity; 1 ms of per-request overhead; 0.1 ms per ms of the queue head's age.
REFERENCE_FLOORS = (1.0, 0.01, 0.1, 0.01, 10.0, 0.001, 1.0, 1.0, 0.1)
# the coefficients a replica's speed scales together (the direction of P0's speed part): engine
# time, not the ratio of a queue's remaining wait to its wait so far
SPEED_SCALED = np.array([name != "queue_age_ratio" for name in COEFFICIENTS])


@dataclass(frozen=True, slots=True)
class FitConfig:
    forgetting: float = 0.995  # weight of an observation per later observation
    prior_strength: float = 0.05  # P0's shape part: I / prior_strength (multiples^2)
    speed_variance: float = 1000.0  # P0's speed part along the prior's multiples (docstring)
    huber_k: float = 3.0  # residuals beyond huber_k x scale are clipped
    initial_scale: float = 0.3  # relative residual scale before any observation
    scale_rate: float = 0.05  # EW weight of a new absolute residual in the scale
    min_scale: float = 0.02  # the scale never drops below: a noiseless stretch cannot freeze the fit
    min_norm_ms: float = 1.0  # smallest prediction an observation is divided by
    reset_ratio: float = 3.0  # fast scale / slow scale beyond which the covariance is reset
    max_multiple: float = 100.0  # a coefficient stays within [0, max_multiple x its reference]

    def __post_init__(self) -> None:
        assert 0.5 < self.forgetting <= 1.0, "forgetting must be in (0.5, 1]"
        assert self.prior_strength > 0 and self.huber_k > 0 and self.initial_scale > 0
        assert self.speed_variance >= 0
        assert 0 < self.scale_rate < 1 and self.min_norm_ms > 0 and self.max_multiple > 1


def residual_norm(predicted_ms: float, y_ms: float, cfg: FitConfig) -> float:
    """sqrt(p y), each at least ``min_norm_ms``: the geometric mean of prediction and observation
    a residual is divided by, so that (y - p) / sqrt(p y) ~ log(y / p)."""
    return math.sqrt(max(predicted_ms, cfg.min_norm_ms) * max(y_ms, cfg.min_norm_ms))


def relative_residual(predicted_ms: float, y_ms: float, cfg: FitConfig) -> float:
    """(y - p) / sqrt(p y) (``residual_norm``): the residual the fit minimises."""
    p = max(predicted_ms, cfg.min_norm_ms)
    return (y_ms - p) / residual_norm(p, y_ms, cfg)


def next_scale(scale: float, residual: float, cfg: FitConfig, rate: float = 0.0, clip: float = 0.0) -> float:
    """The robust scale after one residual: an EW mean (weight ``rate``, default ``scale_rate``)
    of 1.25 x its absolute value clipped to ``clip`` (default ``huber_k x scale``)."""
    rate = rate or cfg.scale_rate
    clip = clip or cfg.huber_k * scale
    dev = 1.25 * min(abs(residual), clip)
    return max(cfg.min_scale, (1 - rate) * scale + rate * dev)


def prior_covariance(w0: npt.NDArray[np.float64], cfg: FitConfig) -> npt.NDArray[np.float64]:
    """P0 for a fit starting at the multiples ``w0`` (module docstring: the prior's speed)."""
    v = np.where(SPEED_SCALED, w0, 0.0)
    p0 = np.eye(len(w0)) / cfg.prior_strength
    norm = float(v @ v)
    if norm > 0 and cfg.speed_variance > 0:
        p0 += cfg.speed_variance * np.outer(v, v) / norm
    return p0


class PriorScale:
    """The same robust scale as ``RobustRls.scale``, of a fixed model's residuals (the prior's,
    beside its fit): whichever predicts better is the one to route on."""

    __slots__ = ("_cfg", "scale")

    def __init__(self, config: FitConfig) -> None:
        self._cfg = config
        self.scale = config.initial_scale

    def update(self, predicted_ms: float, y_ms: float) -> None:
        self.scale = next_scale(self.scale, relative_residual(predicted_ms, y_ms, self._cfg), self._cfg)


class RobustRls:
    """One replica's fit. ``update(x, y_ms)`` with the raw feature vector of the TTFT model."""

    __slots__ = (
        "_cfg",
        "_consts",
        "_p",
        "_p0",
        "_p0_trace",
        "_ref",
        "_scale",
        "_slow_scale",
        "_w",
        "observations",
        "resets",
    )

    def __init__(self, prior: Sequence[float], config: FitConfig) -> None:
        assert len(prior) == len(REFERENCE_FLOORS)
        self._cfg = config
        self._ref = np.maximum(np.asarray(prior, dtype=np.float64), REFERENCE_FLOORS)
        self._w = np.asarray(prior, dtype=np.float64) / self._ref
        self._p0 = prior_covariance(self._w, config)
        self._p = self._p0.copy()
        self._p0_trace = float(np.trace(self._p0))
        self._consts = np.array((0.0, config.forgetting, config.max_multiple, self._p0_trace))
        self._scale = config.initial_scale
        self._slow_scale = config.initial_scale
        self.observations = 0
        self.resets = 0

    def coefficients(self) -> tuple[float, ...]:
        return tuple((self._w * self._ref).tolist())

    @property
    def scale(self) -> float:
        """Robust scale of the relative residuals."""
        return self._scale

    def predict(self, x: Sequence[float]) -> float:
        return dot_scaled(np.asarray(x, dtype=np.float64), self._ref, self._w)

    def update(self, x: Sequence[float], y_ms: float) -> float:
        """Fit one observation; returns its relative residual before the update (unclipped).
        The step itself is compiled (``rls_kernel.rls_step``: the same arithmetic, in place)."""
        cfg = self._cfg
        z = np.asarray(x, dtype=np.float64) * self._ref
        predicted = max(float(np.dot(z, self._w)), cfg.min_norm_ms)
        norm = residual_norm(predicted, y_ms, cfg)  # the fit minimises relative_residual's
        z /= norm
        s = self._scale
        clip = cfg.huber_k * s
        consts = self._consts  # (clip, forgetting, max_multiple, p0_trace): only clip changes
        consts[0] = clip
        e = rls_step(self._w, self._p, z, y_ms / norm, consts)
        self._scale = next_scale(s, e, cfg)
        self._slow_scale = next_scale(self._slow_scale, e, cfg, cfg.scale_rate / 10, clip)
        if self._scale > cfg.reset_ratio * self._slow_scale:
            self._p = self._p0.copy()
            self._slow_scale = self._scale
            self.resets += 1
        self.observations += 1
        return e
