"""``TtftParams.coefficients`` is kept with the params (router_policies/ttft/params.py): it must
follow every way a params is made (constructor, ``dataclasses.replace``, ``with_coefficients``)."""

from __future__ import annotations

import dataclasses

from router_policies.ttft.params import COEFFICIENTS, DEFAULT_PRIOR, SMALL_CPU_PRIOR, TtftParams


def _fields(p: TtftParams) -> tuple[float, ...]:
    return tuple(float(getattr(p, n)) for n in COEFFICIENTS)


def test_the_coefficients_follow_the_fields_however_the_params_are_made() -> None:
    for p in (DEFAULT_PRIOR, SMALL_CPU_PRIOR, TtftParams(1, 2)):
        assert p.coefficients() == _fields(p)
        r = dataclasses.replace(p, step_ms=3.5, queue_age_ratio=0.25)
        assert r.coefficients() == _fields(r) and r.coefficients()[0] == 3.5
        fitted = p.with_coefficients(tuple(float(i) for i in range(len(COEFFICIENTS))), 4, 0.1)
        assert fitted.coefficients() == _fields(fitted) == tuple(float(i) for i in range(len(COEFFICIENTS)))
        assert fitted.chunk_tokens == p.chunk_tokens and fitted.observations == 4
        assert dataclasses.replace(fitted, observations=0) == dataclasses.replace(
            p.with_coefficients(fitted.coefficients(), 0, 0.1), observations=0
        )
