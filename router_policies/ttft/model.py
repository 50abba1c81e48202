"""The TTFT model owner: the one writer of every replica's fit (docs/architecture.md, "Routing
on predicted milliseconds").

Decide, then commit: at dispatch the caller records the request's ``TtftInputs`` on the chosen
replica (``inputs_for`` in ``router_policies.ttft.snapshot``, the very function the policy
predicts with); when the first byte arrives it calls ``observe_first_token(replica, inputs,
observed_ms)``. Between observations ``params(replica)`` returns one immutable ``TtftParams``
that the fleet snapshot carries on ``ReplicaState.ttft``, so policies never see the fit change
under them.

Per replica: a prior (``set_prior``: the replica's profile, so that mixed hardware starts from
the right speed; otherwise the model's default prior) and a ``RobustRls`` fit. Bounded: at most
``max_replicas`` fits, the least recently observed one dropped beyond that (it falls back to its
prior). Observations that cannot be right (negative or non-finite times) are refused, not fitted.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from router_policies.ttft.estimator import FitConfig, PriorScale, RobustRls
from router_policies.ttft.features import TtftInputs, dot, feature_vector, predict
from router_policies.ttft.params import DEFAULT_PRIOR, TtftParams


class _Fit:
    __slots__ = ("exported", "prior", "prior_scale", "rls")

    def __init__(self, prior: TtftParams, config: FitConfig) -> None:
        self.prior = prior
        self.rls = RobustRls(prior.coefficients(), config)
        self.exported = prior
        self.prior_scale = PriorScale(config)  # how well the prior alone predicts the same first tokens


class TtftModel:
    def __init__(
        self,
        prior: TtftParams = DEFAULT_PRIOR,
        config: FitConfig | None = None,
        max_replicas: int = 4096,
    ) -> None:
        assert max_replicas > 0
        self._default_prior = prior
        self._config = config or FitConfig()
        self._max = max_replicas
        self._priors: dict[str, TtftParams] = {}
        self._fits: OrderedDict[str, _Fit] = OrderedDict()

    def set_prior(self, replica: str, prior: TtftParams) -> None:
        """The cold-start model of ``replica`` (its profile); restarts its fit from it."""
        self._priors[replica] = prior
        self._fits.pop(replica, None)

    def forget(self, replica: str) -> None:
        self._priors.pop(replica, None)
        self._fits.pop(replica, None)

    def prior(self, replica: str) -> TtftParams:
        return self._priors.get(replica, self._default_prior)

    def params(self, replica: str) -> TtftParams:
        fit = self._fits.get(replica)
        return fit.exported if fit is not None else self.prior(replica)

    def prior_error(self, replica: str) -> float:
        """The robust relative error scale of ``replica``'s prior on the first tokens its fit has
        seen (the fit's is ``params(replica).error_ratio``; the initial scale before any)."""
        fit = self._fits.get(replica)
        return fit.prior_scale.scale if fit is not None else self._config.initial_scale

    def predict_ms(self, replica: str, inputs: TtftInputs) -> float:
        return predict(self.params(replica), inputs).total_ms

    def observe_first_token(self, replica: str, inputs: TtftInputs, observed_ms: float) -> bool:
        """Fit one first token of ``replica``: ``inputs`` as recorded at dispatch, ``observed_ms``
        from dispatch to first byte. False (nothing changed) for an impossible observation."""
        if not math.isfinite(observed_ms) or observed_ms < 0:
            return False
        fit = self._fits.get(replica)
        if fit is None:
            fit = _Fit(self.prior(replica), self._config)
            self._fits[replica] = fit
            while len(self._fits) > self._max:
                self._fits.popitem(last=False)
        else:
            self._fits.move_to_end(replica)
        params = fit.exported
        # the tiers' fetch time is known, not fitted: the fit sees the rest
        y = max(0.0, observed_ms - inputs.fetch_ms)
        x = feature_vector(inputs, params)
        fit.prior_scale.update(dot(x, fit.prior.coefficients()), y)
        fit.rls.update(x, y)
        fit.exported = params.with_coefficients(fit.rls.coefficients(), fit.rls.observations, fit.rls.scale)
        return True

    def __len__(self) -> int:
        return len(self._fits)
