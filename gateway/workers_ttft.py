"""The TTFT model of a gateway of several processes (``kvgate serve --workers N``;
docs/architecture.md, "Workers"): one fit per replica, owned by the parent, on every worker's
first tokens.

Each worker observes only the first tokens of its own requests (about 1/N of them). So a worker
does not fit: its ``RelayedTtftModel`` sends every observation (replica, the inputs recorded at
dispatch, the observed ms; frame ``F``) to the parent, whose own ``TtftModel`` (the parent's
fleet's, given the same priors, capacities and joins as every worker's, from the same frames)
fits it in the order the observations arrive and publishes the replica's new fit (frame ``U``:
its coefficients, observations, robust error scale and its prior's) to every worker, which
routes on it. The parent fits once per first token rather than every worker fitting every first
token (measured: a fit ~70 us, a published fit 191 bytes, decoded in ~2 us; relaying the
observations instead would cost N fits per first token).

Invariants
* Deterministic: the parent fits the observations in one order, and every worker applies the
  published fits in the order the parent sent them, among the same registration and reload
  frames: every worker routes on the parent's models.
* A worker's prior for a replica is the parent's (same frames, same ``set_prior`` calls), so a
  published fit rebuilt over it (``TtftParams.with_coefficients``) is the parent's exactly.
* ``set_prior`` and ``forget`` drop the replica's published fit, as they drop the parent's fit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from gateway.local_hub_codec import decode_json, encode_json
from router_policies.ttft.features import REFERENCE_INPUTS, TtftInputs
from router_policies.ttft.model import TtftModel
from router_policies.ttft.params import TtftParams

_PUBLISHED = tuple[TtftParams, float]  # the fit and its prior's error scale


def warm_up() -> None:
    """Fit one first token on a throwaway model: the first fit in a process loads the fit's
    compiled kernel (numba, ~180 ms measured), which the parent then pays at start rather than
    stalling, once, the loop that relays the inventory, the touches and the load."""
    TtftModel().observe_first_token("", REFERENCE_INPUTS, 1.0)


def observation_frame(replica: str, inputs: TtftInputs, observed_ms: float) -> bytes:
    return encode_json(b"F", [replica, dataclasses.astuple(inputs), observed_ms])


def decode_observation(payload: bytes) -> tuple[str, TtftInputs, float]:
    replica, inputs, observed_ms = decode_json(payload)
    return str(replica), TtftInputs(*inputs), float(observed_ms)


def fit_frame(model: TtftModel, replica: str) -> bytes:
    """The owner's fit of ``replica``, as the workers apply it (``RelayedTtftModel.publish``)."""
    p = model.params(replica)
    return encode_json(
        b"U",
        [replica, p.coefficients(), p.observations, p.error_ratio, model.prior_error(replica), p.calibration],
    )


class RelayedTtftModel(TtftModel):
    """A worker's TTFT model: observations go to the owner (``send``); ``params`` and
    ``prior_error`` are the owner's, as last published (the prior's before any)."""

    def __init__(self, prior: TtftParams, send: Callable[[bytes], None]) -> None:
        super().__init__(prior)
        self._send = send
        self._published: dict[str, _PUBLISHED] = {}  # bounded by the fleet's replicas

    def observe_first_token(self, replica: str, inputs: TtftInputs, observed_ms: float) -> bool:
        if not math.isfinite(observed_ms) or observed_ms < 0:
            return False
        self._send(observation_frame(replica, inputs, observed_ms))
        return True

    def publish(self, payload: bytes) -> str:
        """Apply the owner's fit (frame ``U``); returns its replica."""
        replica, values, observations, error_ratio, prior_error, calibration = decode_json(payload)
        replica = str(replica)
        fit = self.prior(replica).with_coefficients(
            tuple(values), int(observations), float(error_ratio), float(calibration)
        )
        self._published[replica] = (fit, float(prior_error))
        return replica

    def set_prior(self, replica: str, prior: TtftParams) -> None:
        super().set_prior(replica, prior)
        self._published.pop(replica, None)

    def forget(self, replica: str) -> None:
        super().forget(replica)
        self._published.pop(replica, None)

    def params(self, replica: str) -> TtftParams:
        published = self._published.get(replica)
        return published[0] if published is not None else self.prior(replica)

    def prior_error(self, replica: str) -> float:
        published = self._published.get(replica)
        return published[1] if published is not None else super().prior_error(replica)

    def __len__(self) -> int:
        return len(self._published)
